"""Builds ``gsm8k_train.jsonl``: GSM8K train (openai/grade-school-math, MIT) with each worked solution rewritten
for distillation: the calculator annotations ``<<a=b>>`` removed and the closing ``#### N`` turned into
``The answer is \\boxed{N}.`` (the answer format the rewards and evaluation score); the solution as published
stays beside it (``published``), text in another format than the training rows for conversion's validation
(``sse-pipeline loss --data gsm8k_train --split 'train[-500:]' --solution-field published``).

    python -m scripts.build_gsm8k_train SOURCE.jsonl pipeline/train_data/gsm8k_train.jsonl
"""

from __future__ import annotations

import json
import sys

from pipeline.data import gsm8k_as_trained


def main(source: str, target: str) -> None:
    with open(source) as f, open(target, "w") as out:
        for line in f:
            record = json.loads(line)
            record["published"] = record["solution"]
            record["solution"] = gsm8k_as_trained(record["published"], record["answer"])
            out.write(json.dumps(record, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
