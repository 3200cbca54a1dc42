"""Convert checkpoints to and from Hugging Face safetensors directories.

    miles-lite convert --to-hf CKPT OUT      CKPT: a checkpoint (step_N) or a root (its newest complete one)
    miles-lite convert --from-hf HF_DIR OUT  an initial checkpoint (step 0, weights only) under root OUT
    miles-lite convert --to-hf CKPT OUT --adapter   a LoRA checkpoint's adapters as a PEFT adapter directory

--to-hf writes `model.safetensors` (TP-merged: checkpoints store full HF-named tensors), the
`config.json` and tokenizer files stored with the checkpoint, loadable by
`transformers.AutoModelForCausalLM.from_pretrained(OUT)`. --from-hf writes a checkpoint that
`checkpoint.resume=OUT` loads into a trainer of any TP (weights only; fresh optimizer).
A LoRA checkpoint (`trainer.lora.rank` > 0) converts to its base with the adapters merged in, or with
`--adapter` to `adapter_config.json` + `adapter_model.safetensors`, which `peft.PeftModel.from_pretrained`
loads onto the base.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from miles_lite.checkpoint.async_ckpt import AsyncCheckpointer
from miles_lite.checkpoint.layout import MANIFEST
from miles_lite.checkpoint.payload import CheckpointPayload
from miles_lite.checkpoint.resume import CheckpointReader, newest_complete
from miles_lite.checkpoint.trainer_state import MODEL_PREFIX, hf_assets, hf_pieces


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--to-hf CKPT OUT` or `--from-hf HF_DIR OUT` (exactly one), plus `--no-verify`."""
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--to-hf", nargs=2, metavar=("CKPT", "OUT"), help="checkpoint -> HF safetensors directory")
    mode.add_argument("--from-hf", nargs=2, metavar=("HF_DIR", "OUT"), help="HF directory -> initial checkpoint")
    parser.add_argument("--adapter", action="store_true",
                        help="with --to-hf on a LoRA checkpoint: a PEFT adapter directory, not the merged model")
    parser.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the checkpoint's files")


def to_hf(ckpt: str | Path, out: str | Path, verify: bool = True, adapter: bool = False) -> Path:
    """Write checkpoint `ckpt` as an HF directory `out` (`adapter`: a LoRA checkpoint's PEFT adapter
    directory); returns `out`.

    Raises FileNotFoundError when `ckpt` holds no complete checkpoint or lacks its HF config.
    """
    from miles_lite.checkpoint import lora_convert
    from miles_lite.trainer.hf_convert import save_hf_checkpoint

    path = Path(ckpt)
    if not (path / MANIFEST).is_file():
        found = newest_complete(path)
        if found is None:
            raise FileNotFoundError(f"CKPT={ckpt}: no complete checkpoint there (no {MANIFEST}, no step_N inside)")
        path = found
    reader = CheckpointReader(path, verify=verify)
    lora = lora_convert.lora_info(reader)
    if adapter and lora is None:
        raise ValueError(f"--adapter: CKPT={path} holds full weights, not LoRA adapters; drop --adapter")
    if adapter:
        out_dir = lora_convert.write_adapter(reader, lora, out)
        reader.close()
        return out_dir
    config_file = reader.asset_dir() / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"CKPT={path} has no hf/config.json; it was saved without HF assets")
    state = {name[len(MODEL_PREFIX):]: reader.global_tensor(name) for name in reader.global_names(MODEL_PREFIX)}
    if not state:
        raise ValueError(f"CKPT={path} holds no model/* tensors; it is not a trainer checkpoint")
    config = json.loads(config_file.read_text())
    if lora is not None:
        out_dir = lora_convert.write_merged(reader, lora, config, out)
    else:
        out_dir = save_hf_checkpoint(state, config, out)
    for rel in reader.assets():
        if rel != "config.json":
            target = out_dir / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(reader.asset_dir() / rel, target)
    reader.close()
    return out_dir


def from_hf(hf_dir: str | Path, out: str | Path) -> Path:
    """Write HF directory `hf_dir` as checkpoint step 0 under root `out`; returns the checkpoint path."""
    from miles_lite.trainer.hf_convert import read_hf_state

    src = Path(hf_dir)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"HF_DIR={hf_dir} has no config.json; point it at an HF model directory")
    config = json.loads((src / "config.json").read_text())
    saver = AsyncCheckpointer(out, keep_last=0, async_save=False)
    try:
        payload = CheckpointPayload(pieces=hf_pieces(read_hf_state(src)), shared={"converted_from": str(src)},
                                    assets=hf_assets(config, src), meta={"tensor_names": "hf", "source": str(src)})
        stats = saver.save(0, payload)
    finally:
        saver.close()
    return stats.path


def run(args: argparse.Namespace) -> int:
    """Run the conversion `args` selects; prints the output path; returns 0, or 2 with a message on bad input."""
    try:
        if args.to_hf:
            print(to_hf(args.to_hf[0], args.to_hf[1], verify=not args.no_verify, adapter=args.adapter))
        elif args.adapter:
            raise ValueError("--adapter goes with --to-hf CKPT OUT")
        else:
            print(from_hf(args.from_hf[0], args.from_hf[1]))
    except (FileNotFoundError, ValueError, FileExistsError) as exc:
        print(f"miles-lite convert: {exc}", file=sys.stderr)
        return 2
    return 0
