"""Preference tuning (DPO) against its peers: upstream torchtune 0.6.1's recipe and TRL's DPOTrainer (issue 42).

    python -m bench.preference      # 2 repeats x 3 steps per peer, alternated (10-25 min a 2-step run at load 3-10)
    python -m bench.preference --repeats 3 --steps 8   # 8 steps of 8 pairs: all 64 pairs once
    python -m bench.preference --dry-run         # the commands

Run from the repository root after the README's install, with the peers'
environment present (``bench/peers/README.md``: TRL is no project dependency;
the runs use ``.venv-peers/bin/python`` when it exists).

Model: the bundled SmolLM2-135M-Instruct with LoRA rank 8 (alpha 16, dropout 0)
on q_proj and v_proj; its reference is the same model with the adapter off.
Pairs: ``--pairs`` (64) made from the Alpaca demo by ``python -m bench.peers.pairs``
(written into ``outputs/peers/pairs/`` if missing), tokenized by our tokenizer for
both peers; batch 4 pairs x accumulation 2, ``max_seq_len`` 512, fp32 on CPU,
seed 0, the same pairs per step for every peer. Peers:

* ``upstream``: ``lora_dpo_single_device`` from torchtune's wheel with
  ``bench/configs/upstream_lora_dpo_single_device.yaml`` (``bench.peers.upstream``).
* ``trl``: ``trl.DPOTrainer`` from the same config (``bench.peers.trl_dpo``).
* ``ours``: ``recipes/lora_dpo_single_device.py`` with :data:`OURS_CONFIG`, through
  ``bench.launch``; skipped while either file is missing.

Pairs that do not fill the last micro-batch: upstream's loader drops them
(``drop_last=True``); the Trainer under TRL keeps them as a smaller last
micro-batch. With 64 pairs and 4 x 2 per step none are left over.

Reported per peer (median over repeats of the steps after the first): pairs/s,
non-padding tokens/s (chosen + rejected: every token of the policy's forward;
the reference forward runs the same tokens again), step time, peak RSS.
Results: ``bench/results/preference.{json,md}``.
"""

import argparse
import datetime as dt
import shlex
import sys
from pathlib import Path
from typing import List

from bench import analysis
from bench.peers import harness
from bench.peers.pairs import write_pairs

UPSTREAM_CONFIG = "bench/configs/upstream_lora_dpo_single_device.yaml"
OURS_RECIPE = "recipes/lora_dpo_single_device.py"
# The DPO recipe's SmolLM2 config: the name its author gives it (set it here when it lands).
OURS_CONFIG = "configs/smollm2/135M_lora_dpo_single_device.yaml"
DATA = "assets/data/alpaca_en_demo.json"


def pairs_dir(count: int) -> Path:
    return Path("outputs/peers") / f"pairs_{count}"


def overrides(args: argparse.Namespace, out: Path) -> List[str]:
    """The keys every peer gets: where to write, the sizes, the pairs file and the seed."""
    return [f"output_dir={out}", f"batch_size={args.batch_size}", f"gradient_accumulation_steps={args.ga}",
            "epochs=1", f"max_steps_per_epoch={args.steps}", f"tokenizer.max_seq_len={args.max_seq_len}",
            "seed=0", f"dataset.data_files={pairs_dir(args.pairs) / 'pairs_torchtune.json'}"]


def peers(args: argparse.Namespace) -> List[harness.Peer]:
    py = args.python
    return [
        harness.Peer("upstream", "upstream torchtune 0.6.1 lora_dpo_single_device",
                     lambda out: [py, "-m", "bench.peers.upstream", "--out", str(out / "probe.json"),
                                  "--adapter-seed", "0", "lora_dpo_single_device",
                                  "--config", UPSTREAM_CONFIG, *overrides(args, out)], log="disk_log"),
        harness.Peer("trl", "TRL DPOTrainer (sigmoid loss, reference = adapter off)",
                     lambda out: [py, "-m", "bench.peers.trl_dpo", "--out", str(out / "probe.json"),
                                  "--config", UPSTREAM_CONFIG, *overrides(args, out)], log="jsonl"),
        harness.Peer("ours", f"ours, {OURS_RECIPE}",
                     lambda out: [py, "-m", "bench.launch", "--out", str(out / "probe.json"), OURS_RECIPE,
                                  "--config", OURS_CONFIG, *overrides(args, out)],
                     log="jsonl", needs=(OURS_RECIPE, OURS_CONFIG)),
    ]


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.preference", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (default 3)")
    parser.add_argument("--skip-steps", type=int, default=1, help="first steps left out of the statistics")
    parser.add_argument("--pairs", type=int, default=64, help="preference pairs made from the Alpaca demo")
    parser.add_argument("--batch-size", type=int, default=4, help="pairs per micro-batch")
    parser.add_argument("--ga", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--python", default=harness.default_python(), help="interpreter of every run")
    parser.add_argument("--run-timeout-s", type=float, default=1800)
    parser.add_argument("--wait-quiet-s", type=float, default=120,
                        help="before each run, wait up to this long for other processes to go quiet")
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--work-dir", type=Path, default=Path("outputs/bench/preference"))
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    args = parser.parse_args(argv)
    if args.skip_steps >= args.steps:
        parser.error("--skip-steps must be smaller than --steps")
    if args.steps * args.batch_size * args.ga > args.pairs:
        parser.error(f"{args.steps} steps x {args.batch_size} x {args.ga} pairs is more than --pairs {args.pairs}")
    return args


def markdown(result: dict, all_peers: List[harness.Peer]) -> str:
    s, a = result["summary"], result["settings"]
    rows = []
    for peer in all_peers:
        if peer.name not in s:
            rows.append([peer.label, "—", "—", "—", "—", "—", result["skipped"].get(peer.name, "failed")])
            continue
        m, runs = s[peer.name]["median"], s[peer.name]["runs"]
        rows.append([peer.label, analysis.fmt(m["step_seconds"]), analysis.fmt(m["samples_per_second"] / 2),
                     analysis.fmt(m["tokens_per_second"]), f"{m['peak_gib']:.2f}",
                     ", ".join(f"{r['load_median']:.1f}" for r in runs),
                     ", ".join(analysis.fmt(r["samples_per_second"] / 2) for r in runs)])
    return "\n".join(harness.heading_lines(result) + [
        f"SmolLM2-135M-Instruct, LoRA rank 8 (alpha 16, dropout 0) on q_proj and v_proj, reference = adapter off; "
        f"{a['pairs']} pairs from the Alpaca demo (`python -m bench.peers.pairs`: rejected = another record's "
        f"answer), `max_seq_len` {a['max_seq_len']}, batch {a['batch_size']} pairs x accumulation {a['ga']}, fp32 "
        f"on CPU, seed 0, sigmoid DPO with beta 0.1, no clipping, the same pairs per step for every peer (same "
        f"tokens: {result['same_samples']}), both from our initial adapter. {a['steps']} steps per run, statistics "
        f"over steps {a['skip_steps'] + 1}-{a['steps']} (pairs and tokens of those steps over their time), "
        f"{a['repeats']} repeats alternated; the table gives medians over repeats. Tokens/s: non-padding tokens of "
        "the chosen and rejected sequences (the policy's forward; the reference forward runs them again). "
        "Peak: peak RSS of the process from the first micro-batch.",
        "",
        analysis.markdown_table(["peer", "step (s)", "pairs/s", "tokens/s", "peak RSS (GiB)",
                                 "load average per run", "pairs/s per run"], rows),
        "",
        "## Per-step loss (first run of each peer)",
        "",
        harness.loss_table(result["runs"], all_peers),
        "",
    ]) + "\n"


def main(argv: List[str] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    all_peers = peers(args)
    if args.dry_run:
        for peer in all_peers:
            print(shlex.join(peer.command(args.work_dir / peer.name)))
        return 0
    if not (pairs_dir(args.pairs) / "pairs_torchtune.json").is_file():
        write_pairs(Path(DATA), pairs_dir(args.pairs), args.pairs)
    result = harness.result_header("Preference tuning (DPO): peers on one CPU (issue 42)", argv, "bench.preference")
    result["settings"] = {k: v for k, v in vars(args).items() if not isinstance(v, Path)}
    result["skipped"] = {p.name: f"skipped: {', '.join(p.missing())} does not exist yet"
                         for p in all_peers if p.missing()}
    result["runs"] = harness.alternate(all_peers, args.repeats, args.work_dir, args.steps, args.run_timeout_s,
                                       args.wait_quiet_s)
    result["finished"] = dt.datetime.now().isoformat(timespec="seconds")
    result["versions"] = next((r["versions"] for r in result["runs"] if r.get("versions")), {})
    result["same_samples"] = harness.same_samples(result["runs"])
    result["summary"] = harness.summarize(result["runs"], all_peers, args.skip_steps)
    harness.write(result, args.results_dir, "preference", markdown(result, all_peers))
    return 3 if any(r.get("error") for r in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
