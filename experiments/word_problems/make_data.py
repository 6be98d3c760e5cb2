"""Grade-school word problems with one addition or subtraction of small numbers, as JSONL.

Deterministic (a fixed seed), no downloads. Each line: {"prompt": ..., "answer": "7",
"op": "+"}. Writes train.jsonl and held_out.jsonl; a problem (the exact prompt text) is in
at most one of them.

    python experiments/word_problems/make_data.py --out data/word_problems
"""

import argparse
import json
import os

import numpy as np

NAMES = ["Tom", "Anna", "Ben", "Lucy", "Sam", "Mia", "Leo", "Emma", "Max", "Zoe"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "shells", "coins"]
ADD = ["{n} has {a} {item}. {n} gets {b} more {item}. How many {item} does {n} have now?",
       "There are {a} {item} in a box. {n} puts {b} more {item} in the box. How many {item} "
       "are in the box?"]
SUB = ["{n} has {a} {item}. {n} gives {b} {item} to a friend. How many {item} does {n} "
       "have left?",
       "There are {a} {item} on the table. {n} takes {b} of them. How many {item} are on "
       "the table now?"]
SUFFIX = " Answer with just the number."


def problem(rng: np.random.Generator) -> dict:
  n, item = NAMES[rng.integers(len(NAMES))], ITEMS[rng.integers(len(ITEMS))]
  if rng.random() < 0.5:
    a, b = (int(x) for x in rng.integers(1, 10, size=2))
    text, answer, op = ADD[rng.integers(len(ADD))], a + b, "+"
  else:
    a = int(rng.integers(2, 13))
    b = int(rng.integers(1, a))
    text, answer, op = SUB[rng.integers(len(SUB))], a - b, "-"
  return {"prompt": text.format(n=n, a=a, b=b, item=item) + SUFFIX, "answer": str(answer),
          "op": op}


def make(n_train: int, n_heldout: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
  """Distinct problems: the first n_heldout drawn go to held-out, the next n_train to train."""
  rng, seen, out = np.random.default_rng(seed), set(), []
  while len(out) < n_train + n_heldout:
    p = problem(rng)
    if p["prompt"] not in seen:
      seen.add(p["prompt"])
      out.append(p)
  return out[n_heldout:], out[:n_heldout]


def write(path: str, records: list[dict]) -> None:
  with open(path, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="data/word_problems")
  parser.add_argument("--train", type=int, default=2000)
  parser.add_argument("--heldout", type=int, default=128)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  train, held = make(args.train, args.heldout, args.seed)
  os.makedirs(args.out, exist_ok=True)
  write(os.path.join(args.out, "train.jsonl"), train)
  write(os.path.join(args.out, "held_out.jsonl"), held)
  print(f"{len(train)} train, {len(held)} held-out problems in {args.out}")


if __name__ == "__main__":
  main()
