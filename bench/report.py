"""Turn the runs' raw records into per-case statistics, comparisons, targets and markdown tables.

Pure functions of the records :func:`bench.runner.execute` returns; no process is run here.
"""

from typing import Any, Dict, List, Mapping, Optional, Sequence

from bench import analysis
from bench.analysis import GIB, fmt, fmt_median_spread, markdown_table
from bench.cases import (
    BUDGET_VARIANTS,
    HF_TRAINER,
    OURS_EACH,
    OURS_ONCE,
    OURS_ONCE_DEVICE,
    OURS_UNGROUPED,
    TRANSFORMERS_VARIANTS,
    UPSTREAM,
    VARIANT_LABELS,
)

ACCOUNTING_PIECES = ("count_tokens", "global_sum", "step_record", "logging")


def usable_runs(runs: Sequence[Mapping[str, Any]]) -> List[Mapping[str, Any]]:
    """Runs that finished and were not superseded by a re-run of a busy round."""
    return [r for r in runs if "steps" in r and not r.get("error") and r.get("used", True)]


def accounting_share(run: Mapping[str, Any], skip_steps: int) -> Dict[str, Optional[float]]:
    """Seconds per measured step spent in each accounting piece, and their total share of step time."""
    measured = [s for s in run["steps"] if s["step"] > skip_steps and s.get("period") is not None]
    seconds = sum(s["period"] for s in measured)
    keys = {str(s["step"]) for s in measured}
    pieces = run.get("accounting") or {}
    if not measured or not pieces:
        return {"share": None}
    out: Dict[str, Optional[float]] = {}
    total = 0.0
    for piece in ACCOUNTING_PIECES:
        spent = sum(v for k, v in pieces.get(piece, {}).items() if k in keys)
        out[f"{piece}_ms_per_step"] = 1000 * spent / len(measured)
        total += spent
    out["total_ms_per_step"] = 1000 * total / len(measured)
    out["share"] = total / seconds if seconds else None
    # not part of the cost: the wait for the slowest rank that any first collective of a step absorbs
    waited = sum(v for k, v in pieces.get("peer_wait", {}).items() if k in keys)
    out["peer_wait_ms_per_step"] = 1000 * waited / len(measured) if "peer_wait" in pieces else None
    return out


def padding_fraction(steps: Sequence[Mapping[str, Any]]) -> Optional[float]:
    """Share of the collated positions (rows x padded length, all steps) that are padding; None if unknown."""
    padded = [s.get("padded_tokens") for s in steps]
    if not steps or any(p is None for p in padded) or not sum(padded):
        return None
    return 1.0 - sum(s["non_padding_tokens"] for s in steps) / sum(padded)


def summarize_case(
    runs: Sequence[Mapping[str, Any]], skip_steps: int, flops_per_token_fn, peak_flops: Optional[float]
) -> Dict[str, Any]:
    """Statistics of one case over its repeats.

    Args:
        runs: usable records of this case (one per repeat).
        flops_per_token_fn: mean sample length (tokens) -> model FLOPs per token.
        peak_flops: measured peak FLOP/s of the machine (None: no MFU).
    """
    per_run = [analysis.run_throughput(r["steps"], skip_steps) for r in runs]
    mfus = []
    for run, thr in zip(runs, per_run):
        fpt = flops_per_token_fn(run.get("mean_sample_tokens") or 0.0)
        mfus.append(analysis.mfu(thr["tokens_per_second"], fpt, peak_flops))
    shares = [accounting_share(r, skip_steps) for r in runs]
    summary: Dict[str, Any] = {
        "repeats": len(runs),
        "step_seconds": analysis.summarize([t["step_seconds"] for t in per_run]),
        "tokens_per_second": analysis.summarize([t["tokens_per_second"] for t in per_run]),
        "trainable_tokens_per_second": analysis.summarize([t["trainable_tokens_per_second"] for t in per_run]),
        "peak_memory_gib": analysis.summarize([max(r["peak_memory_bytes"]) / GIB for r in runs]),
        "mfu": analysis.summarize([m for m in mfus if m is not None]),
        "padding_fraction": analysis.summarize([padding_fraction(r["steps"]) for r in runs]),
        "measured_steps": per_run[0]["measured_steps"] if per_run else 0,
        "per_run_tokens_per_second": [t["tokens_per_second"] for t in per_run],
        "best_tokens_per_second": analysis.best_of_repeats_throughput([r["steps"] for r in runs], skip_steps),
        "foreign_cpu": [r.get("foreign_cpu") for r in runs],
    }
    if any(s.get("share") is not None for s in shares):
        summary["accounting"] = {
            key: analysis.summarize([s.get(key) for s in shares])
            for key in [f"{p}_ms_per_step" for p in ACCOUNTING_PIECES]
            + ["total_ms_per_step", "share", "peer_wait_ms_per_step"]
        }
    return summary


def compare_to_upstream(
    ours: Sequence[Mapping[str, Any]], upstream: Sequence[Mapping[str, Any]], skip_steps: int
) -> Dict[str, Any]:
    """Ours vs upstream in one group: throughput ratio, loss agreement, same data.

    ``ratio`` is the ratio of the median tokens/sec (the same tokens, so also
    upstream's step time over ours); ``paired_ratio`` summarizes the ratios of
    the runs of the same repeat (which ran next to each other).
    """
    def tps(run):
        return analysis.run_throughput(run["steps"], skip_steps)["tokens_per_second"]

    ours_tps = analysis.summarize([tps(r) for r in ours])["median"]
    up_tps = analysis.summarize([tps(r) for r in upstream])["median"]
    by_repeat = {r.get("repeat"): r for r in upstream}
    paired = [tps(r) / tps(by_repeat[r.get("repeat")]) for r in ours
              if r.get("repeat") in by_repeat and tps(r) and tps(by_repeat[r.get("repeat")])]
    ours_best = analysis.best_of_repeats_throughput([r["steps"] for r in ours], skip_steps)
    up_best = analysis.best_of_repeats_throughput([r["steps"] for r in upstream], skip_steps)
    out: Dict[str, Any] = {
        "ratio": ours_tps / up_tps if ours_tps and up_tps else None,
        "paired_ratio": analysis.summarize(paired),
        # the same from each step's shortest time over the repeats (analysis.best_of_repeats_throughput)
        "best_ratio": ours_best / up_best if ours_best and up_best else None,
    }
    if ours and upstream:
        a, b = ours[0]["steps"], upstream[0]["steps"]
        out["max_rel_diff_loss"] = analysis.max_relative_difference([s["loss"] for s in a], [s["loss"] for s in b])
        out["max_rel_diff_grad_norm"] = analysis.max_relative_difference(
            [s["grad_norm"] for s in a], [s["grad_norm"] for s in b])
        out["same_tokens"] = [s["trainable_tokens"] for s in a] == [s["trainable_tokens"] for s in b]
        out["upstream_counts_pre_shift"] = [s["trainable_tokens_pre_shift"] for s in b]
        out["ours_counts"] = [s["logged_tokens"] for s in a]
    return out


def evaluate_targets(cases: Mapping[str, Mapping[str, Any]], groups: Mapping[str, Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """The issue's four targets, each with its numbers and met / not met.

    Args:
        cases: case name -> {"group", "variant", "kind", "nproc", "ga", "summary"}.
        groups: group name -> {"kind", "nproc", "ga", "comparisons": {variant: compare_to_upstream(...)}}.
    """
    targets = []

    ratios = []
    for name, g in sorted(groups.items()):
        if g["nproc"] == 1 and g["ga"] in (1, 4):
            for variant, comp in sorted(g["comparisons"].items()):
                ratios.append({"group": name, "variant": variant, "ratio": comp["ratio"]})
    vals = [r["ratio"] for r in ratios if r["ratio"] is not None]
    targets.append({
        "target": "single device: ours / upstream tokens/sec >= 1.0 at GA 1 and GA 4",
        "values": ratios, "met": bool(vals) and min(vals) >= 1.0,
        "worst": min(vals) if vals else None,
    })

    dist = []
    for name, g in sorted(groups.items()):
        if g["nproc"] == 2 and g["ga"] == 4 and OURS_EACH in g["comparisons"]:
            dist.append({"group": name, "variant": OURS_EACH, "ratio": g["comparisons"][OURS_EACH]["ratio"]})
    vals = [d["ratio"] for d in dist if d["ratio"] is not None]
    targets.append({
        "target": "2 processes, GA 4, per-micro-batch mode: ours / upstream >= 1.15",
        "values": dist, "met": bool(vals) and min(vals) >= 1.15, "worst": min(vals) if vals else None,
    })

    mem = []
    by_key: Dict[tuple, Dict[int, float]] = {}
    for c in cases.values():
        if c["variant"] == OURS_EACH and c["summary"]["peak_memory_gib"]["median"] is not None:
            by_key.setdefault((c["kind"], c["nproc"]), {})[c["ga"]] = c["summary"]["peak_memory_gib"]["median"]
    for (kind, nproc), per_ga in sorted(by_key.items()):
        if 1 in per_ga and 8 in per_ga:
            mem.append({"kind": kind, "nproc": nproc, "ga1_gib": per_ga[1], "ga8_gib": per_ga[8],
                        "ratio": per_ga[8] / per_ga[1]})
    vals = [m["ratio"] for m in mem]
    targets.append({
        "target": "per-micro-batch mode: peak memory at GA 8 within 10% of GA 1",
        "values": mem, "met": bool(vals) and max(vals) <= 1.10, "worst": max(vals) if vals else None,
    })

    shares = []
    for name, c in sorted(cases.items()):
        acc = c["summary"].get("accounting")
        if acc and acc["share"]["median"] is not None:
            shares.append({"case": name, "share": acc["share"]["median"],
                           "ms_per_step": acc["total_ms_per_step"]["median"]})
    vals = [s["share"] for s in shares]
    targets.append({
        "target": "accounting (count, one-scalar all-reduces, step record, logging) < 1% of step time",
        "values": shares, "met": bool(vals) and max(vals) < 0.01, "worst": max(vals) if vals else None,
    })
    return targets


# ----------------------------------------------------------------------- tables

def results_table(cases: Mapping[str, Mapping[str, Any]], groups: Mapping[str, Mapping[str, Any]],
                  group_order: Sequence[str]) -> str:
    header = ["case", "implementation", "step time (s)", "tokens/s", "ours / upstream", "peak mem (GiB)",
              "MFU", "max rel. Δ loss vs upstream"]
    rows = []
    for gname in group_order:
        g = groups[gname]
        for variant in (UPSTREAM, OURS_ONCE, OURS_EACH):
            c = cases.get(f"{gname}_{variant}")
            if c is None:
                continue
            s = c["summary"]
            comp = g["comparisons"].get(variant, {})
            ratio = comp.get("ratio")
            ratio_text = "1 (reference)" if variant == UPSTREAM else fmt(ratio, ".2f")
            paired = comp.get("paired_ratio") or {}
            if variant != UPSTREAM and paired.get("n", 0) > 1:
                ratio_text += f" ({fmt(paired['min'], '.2f')}–{fmt(paired['max'], '.2f')})"
            loss = "—" if variant == UPSTREAM else fmt(comp.get("max_rel_diff_loss"), ".1e")
            mfu = s["mfu"]["median"]
            rows.append([
                g["label"], VARIANT_LABELS[variant], fmt_median_spread(s["step_seconds"]),
                fmt_median_spread(s["tokens_per_second"]), ratio_text,
                fmt(s["peak_memory_gib"]["median"], ".2f"), f"{100 * mfu:.1f}%" if mfu is not None else "—", loss,
            ])
    return markdown_table(header, rows, "ll" + "r" * 6)


def memory_table(cases: Mapping[str, Mapping[str, Any]]) -> str:
    per: Dict[tuple, Dict[int, float]] = {}
    for c in cases.values():
        value = c["summary"]["peak_memory_gib"]["median"]
        if value is not None:
            per.setdefault((c["kind"], c["nproc"], c["variant"]), {})[c["ga"]] = value
    gas = sorted({ga for d in per.values() for ga in d})
    header = ["model", "processes", "implementation"] + [f"GA {ga}" for ga in gas] + ["GA max / GA 1"]
    rows = []
    for (kind, nproc, variant), d in sorted(per.items()):
        growth = d[max(d)] / d[1] if 1 in d and len(d) > 1 else None
        rows.append([kind, nproc, VARIANT_LABELS[variant]] + [fmt(d.get(ga), ".2f") for ga in gas]
                    + [fmt(growth, ".2f")])
    return markdown_table(header, rows, "lrl" + "r" * (len(gas) + 1))


def accounting_table(cases: Mapping[str, Mapping[str, Any]], order: Sequence[str]) -> str:
    header = ["case", "count tokens (ms)", "global sums (ms)", "step record (ms)", "logging (ms)",
              "total (ms/step)", "step time (s)", "share", "waiting for peers (ms, not counted)"]
    rows = []
    for name in order:
        c = cases[name]
        acc = c["summary"].get("accounting")
        if not acc:
            continue
        med = {k: v["median"] for k, v in acc.items()}
        rows.append([name, fmt(med["count_tokens_ms_per_step"], ".2f"), fmt(med["global_sum_ms_per_step"], ".2f"),
                     fmt(med["step_record_ms_per_step"], ".2f"), fmt(med["logging_ms_per_step"], ".2f"),
                     fmt(med["total_ms_per_step"], ".2f"), fmt(c["summary"]["step_seconds"]["median"], ".2f"),
                     f"{100 * med['share']:.3f}%" if med["share"] is not None else "—",
                     fmt(med.get("peer_wait_ms_per_step"), ".1f")])
    return markdown_table(header, rows)


def targets_table(targets: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    for t in targets:
        if "tokens/sec" in t["target"] or "upstream >=" in t["target"]:
            detail = ", ".join(f"{v['group']} {v['variant']}: {fmt(v['ratio'], '.2f')}" for v in t["values"])
        elif "memory" in t["target"]:
            detail = ", ".join(f"{v['kind']} {v['nproc']}p: {v['ga1_gib']:.2f} → {v['ga8_gib']:.2f} GiB "
                               f"(×{v['ratio']:.2f})" for v in t["values"])
        else:
            detail = f"largest: {100 * t['worst']:.3f}%" if t["worst"] is not None else ""
        status = "—" if not t["values"] else ("met" if t["met"] else "**not met**")
        rows.append([t["target"], status, detail])
    return markdown_table(["target", "result", "measured"], rows, "lll")


# ------------------------------------------------------------ realistic profile

REALISTIC_ORDER = (UPSTREAM, OURS_ONCE, OURS_EACH, OURS_UNGROUPED, OURS_ONCE_DEVICE, *BUDGET_VARIANTS, HF_TRAINER)
LOSS_MATCH = 1e-5  # grouping and the backward mode only reorder float sums


def realistic_comparisons(by_variant: Mapping[str, Sequence[Mapping[str, Any]]], skip_steps: int) -> Dict[str, Any]:
    """Every pair the realistic report shows, as :func:`compare_to_upstream` of (ours, reference).

    Returns:
        ``{"vs_upstream": {variant: ...}, "vs_ungrouped": {variant: ...}, "vs_hf": {variant: ...},
        "vs_default": {variant: ...}}`` (``vs_default``: against ours with the config's defaults,
        ``ours_once``); a reference absent from the group gives an empty dict.
    """
    out: Dict[str, Any] = {}
    for key, ref in (("vs_upstream", UPSTREAM), ("vs_ungrouped", OURS_UNGROUPED), ("vs_hf", HF_TRAINER),
                     ("vs_default", OURS_ONCE)):
        out[key] = {v: compare_to_upstream(runs, by_variant[ref], skip_steps)
                    for v, runs in by_variant.items() if v != ref and runs and by_variant.get(ref)}
    return out


def evaluate_realistic_targets(cases: Mapping[str, Mapping[str, Any]],
                               groups: Mapping[str, Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Issue 13's targets at realistic settings, each with its numbers and met / not met.

    Args:
        cases: as :func:`evaluate_targets`.
        groups: group name -> {"nproc", "tag", "comparisons": :func:`realistic_comparisons`}; the speed
            target reads the one-device groups tagged ``b8`` (batch 8 x GA 4 in the realistic profile).
    """
    targets = []

    def target(text, values, key, ok):
        vals = [v[key] for v in values if v.get(key) is not None]
        targets.append({"target": text, "values": values, "key": key,
                        "met": bool(vals) and len(vals) == len(values) and all(ok(x) for x in vals)})

    speed = [{"group": name, "variant": OURS_ONCE, "ratio": g["comparisons"]["vs_upstream"][OURS_ONCE]["ratio"]}
             for name, g in sorted(groups.items())
             if g["nproc"] == 1 and g.get("tag") == "b8" and OURS_ONCE in g["comparisons"]["vs_upstream"]]
    target("8 x GA 4, one device: ours / upstream non-padding tokens/s >= 1.5", speed, "ratio", lambda x: x >= 1.5)

    hf = [{"group": name, "variant": OURS_ONCE, "ratio": g["comparisons"]["vs_hf"][OURS_ONCE]["ratio"]}
          for name, g in sorted(groups.items()) if OURS_ONCE in g["comparisons"]["vs_hf"]]
    target("ours (defaults) / HF Trainer non-padding tokens/s >= 1.0 (1 x 4 and 8 x 4)", hf, "ratio",
           lambda x: x >= 1.0)
    hf_best = [{"group": name, "variant": OURS_ONCE, "ratio": g["comparisons"]["vs_hf"][OURS_ONCE].get("best_ratio")}
               for name, g in sorted(groups.items()) if OURS_ONCE in g["comparisons"]["vs_hf"]]
    target("the same from each step's best time over the repeats (what host CPU steal disturbs least)", hf_best,
           "ratio", lambda x: x >= 1.0)
    # Per group, the fastest of ours (defaults, or with the token budget where the group runs it).
    best = []
    for name, g in sorted(groups.items()):
        mine = {v: c["ratio"] for v, c in g["comparisons"]["vs_hf"].items()
                if v in (OURS_ONCE, *BUDGET_VARIANTS) and c.get("ratio") is not None}
        if mine:
            variant = max(mine, key=mine.get)
            best.append({"group": name, "variant": variant, "ratio": mine[variant]})
    target("ours with grouping and token budgets / HF Trainer non-padding tokens/s >= 1.0 (1 x 4 and 8 x 4)",
           best, "ratio", lambda x: x >= 1.0)

    mem = []
    for name, g in sorted(groups.items()):
        up = cases.get(f"{name}_{UPSTREAM}")
        for variant in (OURS_ONCE, OURS_EACH):
            mine = cases.get(f"{name}_{variant}")
            if up and mine:
                a, b = mine["summary"]["peak_memory_gib"]["median"], up["summary"]["peak_memory_gib"]["median"]
                mem.append({"group": name, "variant": variant, "ratio": a / b if a and b else None})
    target("peak memory <= upstream, both backward modes", mem, "ratio", lambda x: x <= 1.0)

    loss = [{"group": name, "variant": v, "diff": comp.get("max_rel_diff_loss")}
            for name, g in sorted(groups.items()) for v, comp in sorted(g["comparisons"]["vs_ungrouped"].items())
            if v in (OURS_ONCE, OURS_EACH, OURS_ONCE_DEVICE)]
    target(f"grouped losses = ungrouped losses (max rel. difference <= {LOSS_MATCH:g})", loss, "diff",
           lambda x: x <= LOSS_MATCH)
    budget = [{"group": name, "variant": v, "diff": g["comparisons"]["vs_default"][v].get("max_rel_diff_loss")}
              for name, g in sorted(groups.items()) for v in BUDGET_VARIANTS
              if v in g["comparisons"]["vs_default"]]
    if budget:
        target(f"token-budget and packed losses = default losses (max rel. difference <= {LOSS_MATCH:g})", budget,
               "diff", lambda x: x <= LOSS_MATCH)
    return targets


def realistic_targets_table(targets: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    for t in targets:
        spec = ".1e" if t["key"] == "diff" else ".2f"
        detail = ", ".join(f"{v['group']} {v['variant']}: {fmt(v[t['key']], spec)}" for v in t["values"])
        status = "—" if not t["values"] else ("met" if t["met"] else "**not met**")
        rows.append([t["target"], status, detail])
    return markdown_table(["target", "result", "measured"], rows, "lll")


def _best_cell(tokens_per_second: Optional[float], ratio_to_hf: Optional[float]) -> str:
    if tokens_per_second is None:
        return "—"
    return fmt(tokens_per_second) + (f" (×{ratio_to_hf:.2f})" if ratio_to_hf is not None else "")


def realistic_table(cases: Mapping[str, Mapping[str, Any]], groups: Mapping[str, Mapping[str, Any]],
                    group_order: Sequence[str]) -> str:
    """One row per case: speed, memory, MFU, padding, and the loss differences to the references."""
    header = ["group", "implementation", "step time (s)", "non-padding tokens/s", "× upstream", "× HF Trainer",
              "best-of-repeats tokens/s (× HF)", "peak mem (GiB)", "MFU", "padding", "max rel. Δ loss vs upstream",
              "vs ungrouped", "vs HF"]
    rows = []
    for gname in group_order:
        g = groups[gname]
        comps = g["comparisons"]
        for variant in REALISTIC_ORDER:
            c = cases.get(f"{gname}_{variant}")
            if c is None:
                continue
            s = c["summary"]
            up, ung, hf = (comps[k].get(variant, {}) for k in ("vs_upstream", "vs_ungrouped", "vs_hf"))
            mfu, pad = s["mfu"]["median"], s["padding_fraction"]["median"]
            rows.append([
                g["label"], VARIANT_LABELS[variant], fmt_median_spread(s["step_seconds"]),
                fmt_median_spread(s["tokens_per_second"]),
                "1" if variant == UPSTREAM else fmt(up.get("ratio"), ".2f"),
                "1" if variant == HF_TRAINER else fmt(hf.get("ratio"), ".2f"),
                _best_cell(s.get("best_tokens_per_second"), 1.0 if variant == HF_TRAINER else hf.get("best_ratio")),
                fmt(s["peak_memory_gib"]["median"], ".2f"), f"{100 * mfu:.1f}%" if mfu is not None else "—",
                f"{100 * pad:.1f}%" if pad is not None else "—",
                fmt(up.get("max_rel_diff_loss"), ".1e"), fmt(ung.get("max_rel_diff_loss"), ".1e"),
                fmt(hf.get("max_rel_diff_loss"), ".1e"),
            ])
    return markdown_table(header, rows, "ll" + "r" * 11)


def loss_table(runs_by_case: Mapping[str, Mapping[str, Any]], order: Sequence[str]) -> str:
    """Per-step loss of the first usable run of every case (full precision, to read the differences)."""
    names = [n for n in order if n in runs_by_case]
    steps = max((len(runs_by_case[n]["steps"]) for n in names), default=0)
    rows = [[n] + [fmt(s.get("loss"), ".7f") for s in runs_by_case[n]["steps"]] + ["—"] * (steps - len(runs_by_case[n]["steps"]))
            for n in names]
    return markdown_table(["case"] + [f"step {k}" for k in range(1, steps + 1)], rows)


# ------------------------------------------------------- transformers path (issue 30)

# The transformers path (our recipe on configs/hf) against the torchtune path (ours on configs/smollm2),
# same weights, tokens, settings and backward mode: its speed at least this share of the torchtune path's,
# its peak memory at most this multiple, its losses within LOSS_MATCH (two implementations of the same
# model only reorder float sums).
TRANSFORMERS_SPEED = 0.95
TRANSFORMERS_MEMORY = 1.05
TORCHTUNE_PATH = OURS_EACH  # the reference of the transformers variants: the same backward mode


def _peak_gib(run: Mapping[str, Any]) -> float:
    return max(run["peak_memory_bytes"]) / GIB


def _median_step_tps(runs: Sequence[Mapping[str, Any]], skip_steps: int) -> Optional[float]:
    """Median over every measured step of every run (same samples per step in each run) of its tokens/sec."""
    return analysis.summarize([t for r in runs for t in analysis.step_throughputs(r["steps"], skip_steps)])["median"]


def transformers_comparison(mine: Sequence[Mapping[str, Any]], reference: Sequence[Mapping[str, Any]],
                            skip_steps: int) -> Dict[str, Any]:
    """The transformers path's runs against the torchtune path's, in one group.

    Returns:
        :func:`compare_to_upstream`'s dict (``max_rel_diff_loss``, ``same_tokens``, ...) plus
        ``step_median_ratio``: ratio of the median per-step non-padding tokens/sec, over every measured
        step of every repeat; ``paired_step_median_ratio``: that ratio per repeat (runs that ran next
        to each other); ``memory_ratio``: ratio of the median peak memory over repeats, and
        ``paired_memory_ratio`` per repeat.
    """
    out = compare_to_upstream(mine, reference, skip_steps)
    a, b = _median_step_tps(mine, skip_steps), _median_step_tps(reference, skip_steps)
    out["step_median_ratio"] = a / b if a and b else None
    by_repeat = {r.get("repeat"): r for r in reference}
    pairs = [(r, by_repeat[r.get("repeat")]) for r in mine if r.get("repeat") in by_repeat]
    speed = [(_median_step_tps([x], skip_steps), _median_step_tps([y], skip_steps)) for x, y in pairs]
    out["paired_step_median_ratio"] = analysis.summarize([x / y for x, y in speed if x and y])
    mem_a = analysis.summarize([_peak_gib(r) for r in mine])["median"]
    mem_b = analysis.summarize([_peak_gib(r) for r in reference])["median"]
    out["memory_ratio"] = mem_a / mem_b if mem_a and mem_b else None
    out["paired_memory_ratio"] = analysis.summarize([_peak_gib(x) / _peak_gib(y) for x, y in pairs])
    return out


def transformers_comparisons(by_variant: Mapping[str, Sequence[Mapping[str, Any]]],
                             skip_steps: int) -> Dict[str, Any]:
    """``{variant: transformers_comparison(...)}`` for each transformers variant of a group with its reference."""
    reference = by_variant.get(TORCHTUNE_PATH)
    return {v: transformers_comparison(runs, reference, skip_steps) for v, runs in by_variant.items()
            if v in TRANSFORMERS_VARIANTS and runs and reference}


def evaluate_transformers_targets(cases: Mapping[str, Mapping[str, Any]],
                                  groups: Mapping[str, Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """Issue 30's targets: speed, memory and loss agreement of the transformers path, per group.

    Args:
        cases: as :func:`evaluate_targets` (unused: the comparisons hold the numbers).
        groups: group name -> {"comparisons": :func:`transformers_comparisons`}.
    """
    targets = []

    def target(text, key, spec, ok):
        values = [{"group": name, "variant": v, "value": comp.get(key)}
                  for name, g in sorted(groups.items()) for v, comp in sorted(g["comparisons"].items())]
        vals = [v["value"] for v in values if v["value"] is not None]
        targets.append({"target": text, "values": values, "spec": spec,
                        "met": bool(vals) and len(vals) == len(values) and all(ok(x) for x in vals)})

    target(f"transformers path / torchtune path non-padding tokens/s (median over steps) >= {TRANSFORMERS_SPEED}",
           "step_median_ratio", ".3f", lambda x: x >= TRANSFORMERS_SPEED)
    target(f"transformers path / torchtune path peak memory <= {TRANSFORMERS_MEMORY}", "memory_ratio", ".3f",
           lambda x: x <= TRANSFORMERS_MEMORY)
    target(f"same losses (max rel. difference per step <= {LOSS_MATCH:g})", "max_rel_diff_loss", ".1e",
           lambda x: x <= LOSS_MATCH)
    target("same trainable tokens per step", "same_tokens", "", lambda x: x is True)
    return targets


def transformers_targets_table(targets: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    for t in targets:
        detail = ", ".join(f"{v['group']} {v['variant']}: "
                           + (fmt(v["value"], t["spec"]) if t["spec"] else str(v["value"])) for v in t["values"])
        status = "—" if not t["values"] else ("met" if t["met"] else "**not met**")
        rows.append([t["target"], status, detail])
    return markdown_table(["target", "result", "measured"], rows, "lll")


def _load(runs: Sequence[Mapping[str, Any]]) -> Dict[str, Optional[float]]:
    """Median 1-minute load average sampled during the runs, and the CPU cores other processes used."""
    samples = [s[0] for r in runs for s in (r.get("load_samples") or [])]
    return {"load": analysis.summarize(samples)["median"],
            "foreign": analysis.summarize([r.get("foreign_cpu") for r in runs])["median"]}


def transformers_table(cases: Mapping[str, Mapping[str, Any]], groups: Mapping[str, Mapping[str, Any]],
                       group_order: Sequence[str], runs_by_case: Mapping[str, Sequence[Mapping[str, Any]]],
                       skip_steps: int) -> str:
    """One row per case: per-step median tokens/s, ratios (also from each step's best time over the repeats,
    :func:`bench.analysis.best_of_repeats_throughput`), peak memory, ratio, loss difference, load."""
    header = ["group", "implementation", "step time (s)", "non-padding tokens/s (median over steps)",
              "× torchtune path (per repeat)", "× from best step times", "peak mem (GiB)", "× torchtune path",
              "max rel. Δ loss",
              "load average (1 min)", "other processes (cores)"]
    rows = []
    for gname in group_order:
        g = groups[gname]
        for variant in (TORCHTUNE_PATH, *TRANSFORMERS_VARIANTS):
            c = cases.get(f"{gname}_{variant}")
            if c is None:
                continue
            s, comp = c["summary"], g["comparisons"].get(variant, {})
            runs = runs_by_case.get(f"{gname}_{variant}", [])
            paired = comp.get("paired_step_median_ratio") or {}
            ratio = "1" if variant == TORCHTUNE_PATH else fmt(comp.get("step_median_ratio"), ".3f")
            if paired.get("n", 0) > 1:
                ratio += f" ({fmt(paired['min'], '.2f')}–{fmt(paired['max'], '.2f')})"
            load = _load(runs)
            rows.append([
                g["label"], VARIANT_LABELS[variant], fmt_median_spread(s["step_seconds"]),
                fmt(_median_step_tps(runs, skip_steps)), ratio,
                "1" if variant == TORCHTUNE_PATH else fmt(comp.get("best_ratio"), ".3f"),
                fmt(s["peak_memory_gib"]["median"], ".2f"),
                "1" if variant == TORCHTUNE_PATH else fmt(comp.get("memory_ratio"), ".3f"),
                "—" if variant == TORCHTUNE_PATH else fmt(comp.get("max_rel_diff_loss"), ".1e"),
                fmt(load["load"], ".2f"), fmt(load["foreign"], ".2f"),
            ])
    return markdown_table(header, rows, "ll" + "r" * 9)
