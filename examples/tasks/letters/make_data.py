"""Write the letters task's records: `python examples/tasks/letters/make_data.py` (deterministic).

Every sequence of 3 letters from a-h (512) is one record: `{"prompt": "reverse: b d a", "label": "a d b",
"response": "a d b", "data_source": "reverse", "metadata": {"letters": 3}}`. A seeded shuffle puts 384
of them in `train.jsonl` and 128 in `eval.jsonl` (held out: no sequence is in both). `mix_train.jsonl`
and `mix_eval.jsonl` add the same sequences under a second source, "sort" (label: the letters in
alphabetical order), for the two-source example routed by `rewards.by_source`.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

LETTERS = "abcdefgh"
HERE = Path(__file__).resolve().parent


def record(seq: tuple[str, ...], task: str) -> dict:
    answer = " ".join(reversed(seq)) if task == "reverse" else " ".join(sorted(seq))
    return {"prompt": f"{task}: {' '.join(seq)}", "label": answer, "response": answer, "data_source": task,
            "metadata": {"letters": len(seq)}}


def write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def main() -> None:
    seqs = list(itertools.product(LETTERS, repeat=3))
    random.Random(0).shuffle(seqs)
    train, held_out = seqs[:384], seqs[384:]
    write(HERE / "train.jsonl", [record(s, "reverse") for s in train])
    write(HERE / "eval.jsonl", [record(s, "reverse") for s in held_out])
    mixed = [record(s, task) for s in train for task in ("reverse", "sort")]
    random.Random(1).shuffle(mixed)
    write(HERE / "mix_train.jsonl", mixed)
    write(HERE / "mix_eval.jsonl", [record(s, task) for s in held_out[:64] for task in ("reverse", "sort")])


if __name__ == "__main__":
    main()
