"""Write the lookup-chain task's records: `python examples/agents/lookup/make_data.py` (deterministic).

Each record hides a chain of two lookups in its own table: the question is a number, `lookup` of it gives a
second number, `lookup` of that gives the answer. The table is drawn per record, so no answer can be learnt or
guessed from the question: the model has to call the tool, read its result, call it again with that result,
and answer with what the second call returned (three model turns, two tool results between them):

    {"messages": [{"role": "system", "content": "Follow the chain."}, {"role": "user", "content": "47"}],
     "label": "35", "metadata": {"table": {"47": "82", "82": "35"}},
     "response": [assistant: lookup 47, tool: 82, assistant: lookup 82, tool: 35, assistant: 35]}

`response` is the reference trajectory the SFT warm-up trains on (assistant turns trained, tool results out of
the loss). 1500 records go to `train.jsonl`, 500 to `eval.jsonl` (held-out questions: no question of the
evaluation set is one of training's).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEM = "Follow the chain."


def _call(i: int, query: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{i}", "type": "function",
         "function": {"name": "lookup", "arguments": json.dumps({"query": query})}}]}


def record(rng: random.Random, question: str) -> dict:
    middle, answer = (str(rng.randint(10, 99)) for _ in range(2))
    response = [_call(0, question), {"role": "tool", "tool_call_id": "call_0", "content": middle},
                _call(1, middle), {"role": "tool", "tool_call_id": "call_1", "content": answer},
                {"role": "assistant", "content": answer}]
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "label": answer, "metadata": {"table": {question: middle, middle: answer}}, "response": response}


def write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records), encoding="utf-8")


def main() -> None:
    rng = random.Random(0)
    questions = [str(q) for q in range(10, 100)]
    held_out = set(rng.sample(questions, 18))  # a fifth of the questions appear only in evaluation
    train_q = [q for q in questions if q not in held_out]
    write(HERE / "train.jsonl", [record(rng, rng.choice(train_q)) for _ in range(1500)])
    write(HERE / "eval.jsonl", [record(rng, rng.choice(sorted(held_out))) for _ in range(500)])


if __name__ == "__main__":
    main()
