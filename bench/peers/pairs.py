"""A small deterministic preference set from instruction records (the bundled Alpaca demo has no pairs).

    python -m bench.peers.pairs --out-dir outputs/peers/pairs [--data assets/data/alpaca_en_demo.json] [--count 64]

writes the same pairs in two formats:

* ``pairs_trl.jsonl``: TRL's conversational preference format, one pair a line,
  ``{"prompt": [user message], "chosen": [assistant message], "rejected": [assistant message]}``
  (each message ``{"role", "content"}``), as ``DPOTrainer`` reads it.
* ``pairs_torchtune.json``: torchtune's ``preference_dataset`` format, a JSON list of
  ``{"chosen": [user, assistant], "rejected": [user, assistant]}`` message lists,
  read with ``source: json, data_files: <this file>``.

How a pair is made (:func:`make_pairs`): record ``i`` gives the prompt (its
``instruction``, then a blank line and its ``input`` when it has one) and the
chosen response (its own ``output``). The rejected response is the ``output``
of another record, ``(i + shift) mod n`` with ``shift = n // 2`` (the other
half of the file), skipping any whose text equals the chosen one: a fluent,
well-formed answer to a different instruction, so plausible as text but wrong
for the prompt. Taken from real responses, rejected responses have the length
distribution of chosen ones, which a benchmark needs (a truncated or shuffled
copy of the chosen answer would make rejected sequences systematically shorter
or trivially detectable); and the preference is unambiguous, which a training
smoke test needs (the policy should learn to prefer the on-topic answer).

Self-contained on purpose (standard library only): the preference recipe's
asset step is to take it over as it is.
"""

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence


def prompt_of(record: Mapping[str, str]) -> str:
    """The user turn of an instruction record: ``instruction``, plus a blank line and ``input`` if non-empty."""
    extra = (record.get("input") or "").strip()
    return record["instruction"].strip() + (f"\n\n{extra}" if extra else "")


def make_pairs(records: Sequence[Mapping[str, str]], count: int) -> List[Dict[str, str]]:
    """``count`` preference pairs from the first ``count`` records with a non-empty ``output``.

    Args:
        records: instruction records with ``instruction``, ``output`` and optionally ``input`` (Alpaca).
        count: pairs to make.

    Returns:
        ``[{"prompt": str, "chosen": str, "rejected": str, "source": i, "rejected_source": j}]``:
        ``chosen`` is record ``i``'s own output, ``rejected`` the output of record
        ``j = (i + k) mod n`` for the smallest ``k >= n // 2`` whose output is non-empty and
        differs from the chosen one (``n = len(records)``). The same records give the same pairs.

    Raises:
        ValueError: fewer than ``count`` usable records, or fewer than 2 records.
    """
    n = len(records)
    if n < 2:
        raise ValueError(f"need at least 2 records to pair, got {n}")
    usable = [i for i, r in enumerate(records) if (r.get("output") or "").strip()]
    if len(usable) < count:
        raise ValueError(f"{len(usable)} records have an output, {count} pairs asked for")
    pairs = []
    for i in usable[:count]:
        chosen = records[i]["output"].strip()
        for k in range(n // 2, n // 2 + n):
            j = (i + k) % n
            rejected = (records[j].get("output") or "").strip()
            if j != i and rejected and rejected != chosen:
                break
        else:
            raise ValueError(f"no other record has an output different from record {i}'s")
        pairs.append({"prompt": prompt_of(records[i]), "chosen": chosen, "rejected": rejected,
                      "source": i, "rejected_source": j})
    return pairs


def trl_rows(pairs: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """TRL's conversational preference rows: ``prompt`` (user turn), ``chosen`` and ``rejected`` (assistant turns)."""
    return [{"prompt": [{"role": "user", "content": p["prompt"]}],
             "chosen": [{"role": "assistant", "content": p["chosen"]}],
             "rejected": [{"role": "assistant", "content": p["rejected"]}]} for p in pairs]


def torchtune_rows(pairs: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """torchtune's ``preference_dataset`` rows: ``chosen`` and ``rejected`` as whole conversations."""
    def chat(prompt: str, reply: str) -> List[Dict[str, str]]:
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]

    return [{"chosen": chat(p["prompt"], p["chosen"]), "rejected": chat(p["prompt"], p["rejected"])} for p in pairs]


def write_pairs(data: Path, out_dir: Path, count: int) -> Dict[str, Path]:
    """Read the JSON list of records ``data``, write both files into ``out_dir``; returns their paths by format."""
    pairs = make_pairs(json.loads(Path(data).read_text()), count)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"trl": out_dir / "pairs_trl.jsonl", "torchtune": out_dir / "pairs_torchtune.json"}
    paths["trl"].write_text("".join(json.dumps(row) + "\n" for row in trl_rows(pairs)))
    paths["torchtune"].write_text(json.dumps(torchtune_rows(pairs), indent=1) + "\n")
    return paths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.peers.pairs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("assets/data/alpaca_en_demo.json"),
                        help="JSON list of Alpaca records (default: the bundled demo)")
    parser.add_argument("--count", type=int, default=64, help="pairs to make (default 64)")
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    paths = write_pairs(args.data, args.out_dir, args.count)
    print(f"{args.count} pairs from {args.data}: " + ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
