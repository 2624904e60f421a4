"""Knowledge distillation against its peers: upstream torchtune 0.6.1's recipe and TRL's GKDTrainer (issue 41).

    python -m bench.distillation    # 2 repeats x 3 steps per peer, alternated (8-23 min a run at load 3-13)
    python -m bench.distillation --repeats 3 --steps 4
    python -m bench.distillation --dry-run       # the commands

Run from the repository root after the README's install, in the peers'
environment or with it present (``bench/peers/README.md``: TRL is no project
dependency; the runs use ``.venv-peers/bin/python`` when it exists).

Teacher: the bundled SmolLM2-135M-Instruct. Student: its first ``--layers``
decoder layers (``python -m bench.peers.student``, written into
``outputs/peers/`` if missing), trained through LoRA (rank 8, alpha 16, q/k/v/o
and MLP). Data: the Alpaca demo with prompts masked, ``tokenizer.max_seq_len``
512, batch 4 x accumulation 2, fp32 on CPU, seed 0, the same samples per step
for every peer. Peers:

* ``upstream``: ``knowledge_distillation_single_device`` from torchtune's wheel
  with ``bench/configs/upstream_kd_lora_single_device.yaml`` (``kd_ratio`` 1: the
  distillation loss alone), run by ``bench.peers.upstream``.
* ``trl``: ``trl.experimental.gkd.GKDTrainer`` with ``lmbda=0`` (offline),
  ``beta=0`` (forward KL), from the same config (``bench.peers.trl_gkd``).
* ``ours``: ``recipes/knowledge_distillation_single_device.py`` with
  :data:`OURS_CONFIG`, through ``bench.launch``; skipped while either file is missing.

Both peers start from the adapter our recipes draw from the seed. Reported per
peer (median over repeats of the steps after the first): non-padding student
tokens/s, learned (label) tokens/s, step time, peak RSS, and the teacher's
forward as a share of the step (hooks on the teacher module). Results:
``bench/results/distillation.{json,md}``.
"""

import argparse
import datetime as dt
import shlex
import sys
from pathlib import Path
from typing import List

from bench import analysis
from bench.peers import harness
from bench.peers.student import write_student

UPSTREAM_CONFIG = "bench/configs/upstream_kd_lora_single_device.yaml"
OURS_RECIPE = "recipes/knowledge_distillation_single_device.py"
# The distillation recipe's SmolLM2 config: the name its author gives it (set it here when it lands).
OURS_CONFIG = "configs/smollm2/135M_KD_lora_single_device.yaml"
TEACHER = "assets/SmolLM2-135M-Instruct"


def student_dir(layers: int) -> Path:
    return Path("outputs/peers") / f"SmolLM2-135M-Instruct-{layers}L"


def overrides(args: argparse.Namespace, out: Path) -> List[str]:
    """The keys every peer gets: where to write, the sizes, the student folder and the seed."""
    return [f"output_dir={out}", f"batch_size={args.batch_size}", f"gradient_accumulation_steps={args.ga}",
            "epochs=1", f"max_steps_per_epoch={args.steps}", f"tokenizer.max_seq_len={args.max_seq_len}",
            "seed=0", f"model.num_layers={args.layers}", f"checkpointer.checkpoint_dir={student_dir(args.layers)}"]


def peers(args: argparse.Namespace) -> List[harness.Peer]:
    py = args.python
    return [
        harness.Peer("upstream", "upstream torchtune 0.6.1 knowledge_distillation_single_device (kd_ratio 1)",
                     lambda out: [py, "-m", "bench.peers.upstream", "--out", str(out / "probe.json"),
                                  "--adapter-seed", "0", "knowledge_distillation_single_device",
                                  "--config", UPSTREAM_CONFIG, *overrides(args, out)], log="disk_log"),
        harness.Peer("trl", "TRL GKDTrainer, lmbda=0 (offline), beta=0 (forward KL)",
                     lambda out: [py, "-m", "bench.peers.trl_gkd", "--out", str(out / "probe.json"),
                                  "--config", UPSTREAM_CONFIG, *overrides(args, out)], log="jsonl"),
        harness.Peer("ours", f"ours, {OURS_RECIPE}",
                     lambda out: [py, "-m", "bench.launch", "--out", str(out / "probe.json"), OURS_RECIPE,
                                  "--config", OURS_CONFIG, *overrides(args, out)],
                     log="jsonl", needs=(OURS_RECIPE, OURS_CONFIG)),
    ]


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.distillation", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (default 3)")
    parser.add_argument("--skip-steps", type=int, default=1, help="first steps left out of the statistics")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--ga", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--layers", type=int, default=10, help="decoder layers of the student")
    parser.add_argument("--python", default=harness.default_python(), help="interpreter of every run")
    parser.add_argument("--run-timeout-s", type=float, default=1800)
    parser.add_argument("--wait-quiet-s", type=float, default=120,
                        help="before each run, wait up to this long for other processes to go quiet")
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--work-dir", type=Path, default=Path("outputs/bench/distillation"))
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    args = parser.parse_args(argv)
    if args.skip_steps >= args.steps:
        parser.error("--skip-steps must be smaller than --steps")
    return args


def markdown(result: dict, all_peers: List[harness.Peer]) -> str:
    s, a = result["summary"], result["settings"]
    rows = []
    for peer in all_peers:
        if peer.name not in s:
            rows.append([peer.label, "—", "—", "—", "—", "—", "—", result["skipped"].get(peer.name, "failed")])
            continue
        m, runs = s[peer.name]["median"], s[peer.name]["runs"]
        rows.append([peer.label, analysis.fmt(m["step_seconds"]), analysis.fmt(m["tokens_per_second"]),
                     analysis.fmt(m["trainable_tokens_per_second"]), f"{m['peak_gib']:.2f}",
                     f"{100 * m['teacher_share']:.0f}%" if "teacher_share" in m else "—",
                     ", ".join(f"{r['load_median']:.1f}" for r in runs),
                     ", ".join(analysis.fmt(r["tokens_per_second"]) for r in runs)])
    return "\n".join(harness.heading_lines(result) + [
        f"Teacher SmolLM2-135M-Instruct (30 layers), student its first {a['layers']} layers with LoRA (rank 8, "
        f"alpha 16, q/k/v/o and MLP), Alpaca demo (prompts masked), `max_seq_len` {a['max_seq_len']}, batch "
        f"{a['batch_size']} x accumulation {a['ga']}, fp32 on CPU, seed 0, the same samples per step for every "
        f"peer (same tokens: {result['same_samples']}), both from our initial adapter. {a['steps']} steps per run, "
        f"statistics over steps {a['skip_steps'] + 1}-{a['steps']} (tokens of those steps over their time), "
        f"{a['repeats']} repeats alternated; the table gives medians over repeats. Tokens/s: non-padding "
        "student tokens (every position the student and teacher run); learned: label tokens after the shift. "
        "Peak: peak RSS of the process from the first micro-batch. Teacher share: the teacher's forward "
        "(hooks on the teacher module) over the step's wall time.",
        "",
        analysis.markdown_table(["peer", "step (s)", "tokens/s", "learned tokens/s", "peak RSS (GiB)",
                                 "teacher share", "load average per run", "tokens/s per run"], rows),
        "",
        "## Per-step loss (first run of each peer)",
        "",
        "upstream logs torchtune's `ForwardKLLoss`, the student's cross-entropy under the teacher's distribution "
        "(KL(teacher ‖ student) plus the teacher's entropy, per learned token); TRL logs KL(teacher ‖ student) "
        "per learned token. Same gradient, losses apart by the teacher's mean entropy over the step's learned "
        "positions. upstream also scales its gradients by 1 / (the step's learned tokens) after each micro-batch's "
        "loss was already a mean over its own tokens, so its gradient (and logged `grad_norm`) is that many "
        "times smaller than TRL's; AdamW is nearly invariant to that scale, clipping is not.",
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
    if not (student_dir(args.layers) / "model.safetensors").is_file():
        write_student(Path(TEACHER), student_dir(args.layers), args.layers)
    result = harness.result_header("Distillation: peers on one CPU (issue 41)", argv, "bench.distillation")
    result["settings"] = {k: v for k, v in vars(args).items() if not isinstance(v, Path)}
    result["skipped"] = {p.name: f"skipped: {', '.join(p.missing())} does not exist yet"
                         for p in all_peers if p.missing()}
    result["runs"] = harness.alternate(all_peers, args.repeats, args.work_dir, args.steps, args.run_timeout_s,
                                       args.wait_quiet_s)
    result["finished"] = dt.datetime.now().isoformat(timespec="seconds")
    result["versions"] = next((r["versions"] for r in result["runs"] if r.get("versions")), {})
    result["same_samples"] = harness.same_samples(result["runs"])
    result["summary"] = harness.summarize(result["runs"], all_peers, args.skip_steps)
    harness.write(result, args.results_dir, "distillation", markdown(result, all_peers))
    return 3 if any(r.get("error") for r in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
