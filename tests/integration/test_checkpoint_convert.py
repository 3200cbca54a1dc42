"""`miles-lite convert`: HF -> initial checkpoint -> HF round trip, loaded by transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_harness import make_test_checkpoint

from miles_lite.checkpoint import CheckpointReader
from miles_lite.cli import main


def test_from_hf_then_to_hf_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM

    from miles_lite.data.tokenizer import build_tokenizer

    src = make_test_checkpoint("llama", tmp_path / "hf", vocab_size=300)
    build_tokenizer(src, vocab_size=300)
    assert main(["convert", "--from-hf", str(src), str(tmp_path / "ckpt")]) == 0
    ckpt = Path(capsys.readouterr().out.strip())
    reader = CheckpointReader(ckpt)
    assert reader.step == 0 and "tokenizer.json" in set(reader.assets())
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), str(tmp_path / "back")]) == 0
    original = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    for name, tensor in original.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    ids = torch.tensor([[1, 5, 9, 42]])
    with torch.no_grad():
        assert torch.equal(original(ids).logits, back(ids).logits)
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_convert_errors_name_the_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "--to-hf", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "CKPT=" in capsys.readouterr().err
    assert main(["convert", "--from-hf", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "HF_DIR=" in capsys.readouterr().err
