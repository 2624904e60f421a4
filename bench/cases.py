"""The benchmark's case matrix, its profiles (cpu, quick, gpu, realistic, ...) and the command of each run."""

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parent.parent

UPSTREAM = "upstream"
OURS_ONCE = "ours_once"
OURS_ONCE_DEVICE = "ours_once_device"
OURS_EACH = "ours_each"
OURS_UNGROUPED = "ours_ungrouped"
OURS_BUDGET = "ours_budget"
OURS_PACKED = "ours_packed"
OURS_PACKED_2048 = "ours_packed_2048"
HF_TRAINER = "hf_trainer"
# Our recipe on the transformers model of the same folder (configs/hf, torchtune_ext.model.hf), per micro-batch
OURS_HF_EACH = "ours_hf_each"
VARIANTS = (UPSTREAM, OURS_ONCE, OURS_EACH)

VARIANT_LABELS = {
    UPSTREAM: "upstream torchtune 0.6.1 (backward per micro-batch)",
    OURS_ONCE: "ours, backward=auto",
    OURS_ONCE_DEVICE: "ours, backward=auto, once_per_step_memory_limit=device",
    OURS_EACH: "ours, backward=per_micro_batch",
    OURS_UNGROUPED: "ours, backward once per step, group_by_length=false",
    OURS_BUDGET: "ours, backward once per step, max_tokens_per_micro_batch=1024",
    OURS_PACKED: "ours, backward once per step, max_tokens_per_micro_batch=1024, pack_micro_batches=true",
    OURS_PACKED_2048: "ours, backward once per step, max_tokens_per_micro_batch=2048, pack_micro_batches=true",
    HF_TRAINER: "Hugging Face Trainer (transformers), token-normalized loss",
    OURS_HF_EACH: "ours, transformers model (configs/hf), backward=per_micro_batch",
}

# Overrides that make a variant of ours what its name says, after the common
# ones (so they win). ours_once/ours_each keep the config's grouping (on).
VARIANT_OVERRIDES: Dict[str, Tuple[str, ...]] = {
    OURS_ONCE: ("backward=auto",),
    # once per step wherever the device has the memory, not only where torchtune's recipe
    # would need as much (the default limit): what ours_once measured before 2026-12-02
    OURS_ONCE_DEVICE: ("backward=auto", "once_per_step_memory_limit=device"),
    OURS_EACH: ("backward=per_micro_batch",),
    OURS_HF_EACH: ("backward=per_micro_batch",),
    OURS_UNGROUPED: ("backward=auto", "group_by_length=false"),
    # At batch 1 x GA 4 x 256 tokens: the step's 4 samples in one micro-batch of at
    # most 1024 padded positions, the memory bound of batch 4 x 256.
    OURS_BUDGET: ("backward=auto", "max_tokens_per_micro_batch=1024"),
    # the same samples concatenated into one row of at most 1024 tokens: no padding
    OURS_PACKED: ("backward=auto", "max_tokens_per_micro_batch=1024", "pack_micro_batches=true"),
    # At batch 8 x GA 4 x 512: rows of up to 2048 tokens (4 samples of the longest length, ~9 of the
    # average Alpaca one); ours_packed's rows of 1024 there hold half as many. A row's block-causal
    # attention costs its length squared on CPU SDPA.
    OURS_PACKED_2048: ("backward=auto", "max_tokens_per_micro_batch=2048", "pack_micro_batches=true"),
}
# Variants that rearrange the step's samples beyond grouping (their losses must equal the defaults').
BUDGET_VARIANTS = (OURS_BUDGET, OURS_PACKED, OURS_PACKED_2048)

# The seed of every run: upstream's sampler is seeded with 0 whatever its config says.
SEED = 0

# (implementation, kind, distributed) -> (recipe, config). Ours are files run
# from the repository root; upstream's are the built-in recipes of torchtune's
# wheel, by name, with configs under bench/configs/ that point them at our
# model, tokenizer and data.
RECIPES: Dict[Tuple[str, str, bool], Tuple[str, str]] = {
    ("ours", "full", False): ("recipes/full_finetune_single_device.py", "configs/smollm2/135M_full_single_device.yaml"),
    ("ours", "lora", False): ("recipes/lora_finetune_single_device.py", "configs/smollm2/135M_lora_single_device.yaml"),
    ("ours", "full", True): ("recipes/full_finetune_distributed.py", "configs/smollm2/135M_full.yaml"),
    ("ours", "lora", True): ("recipes/lora_finetune_distributed.py", "configs/smollm2/135M_lora.yaml"),
    (UPSTREAM, "full", False): ("full_finetune_single_device", "bench/configs/upstream_full_single_device.yaml"),
    (UPSTREAM, "lora", False): ("lora_finetune_single_device", "bench/configs/upstream_lora_single_device.yaml"),
    (UPSTREAM, "full", True): ("full_finetune_distributed", "bench/configs/upstream_full_distributed.yaml"),
    (UPSTREAM, "lora", True): ("lora_finetune_distributed", "bench/configs/upstream_lora_distributed.yaml"),
}


# The transformers path: variants that run our recipe on configs/hf/<recipe>.yaml (the model built
# by transformers from the folder our torchtune config's checkpointer reads), every key outside the
# model and checkpointer sections set to the torchtune config's value (transformers_path_overrides).
TRANSFORMERS_VARIANTS = (OURS_HF_EACH,)
TRANSFORMERS_CONFIGS: Dict[str, str] = {
    "full": "configs/hf/full_single_device.yaml",
    "lora": "configs/hf/lora_single_device.yaml",
}
# Top-level keys where the two paths differ by design: what builds and loads the model, and where runs write.
MODEL_KEYS = ("model", "checkpointer", "model_dir", "output_dir")


@dataclass(frozen=True)
class Group:
    """Runs that are compared with each other: same model kind, processes and accumulation."""

    kind: str  # "full" or "lora"
    nproc: int
    ga: int
    variants: Tuple[str, ...] = VARIANTS
    # Group-level settings that replace the profile's (None: the profile's), for
    # profiles whose groups differ in micro-batch size or sequence length.
    batch_size: Optional[int] = None
    max_seq_len: Optional[int] = None
    tag: str = ""  # appended to the name, to tell apart groups that differ only in the settings above

    @property
    def name(self) -> str:
        where = "1dev" if self.nproc == 1 else f"{self.nproc}proc"
        return f"{self.kind}_{where}_ga{self.ga}" + (f"_{self.tag}" if self.tag else "")

    @property
    def label(self) -> str:
        where = "1 device" if self.nproc == 1 else f"{self.nproc} processes"
        text = f"{self.kind} · {where} · GA {self.ga}"
        if self.batch_size is not None:
            text += f" · batch {self.batch_size}"
        if self.max_seq_len is not None:
            text += f" · len {self.max_seq_len}"
        return text


@dataclass(frozen=True)
class Case:
    group: Group
    variant: str

    @property
    def name(self) -> str:
        return f"{self.group.name}_{self.variant}"

    @property
    def impl(self) -> str:
        """``upstream``, ``hf`` or ``ours``: which program runs (and how its logs are read)."""
        if self.variant == UPSTREAM:
            return UPSTREAM
        return "hf" if self.variant == HF_TRAINER else "ours"

    @property
    def model_path(self) -> str:
        """``transformers`` (our recipe on configs/hf, the HF Trainer) or ``torchtune``: which code builds the model."""
        return "transformers" if self.variant in TRANSFORMERS_VARIANTS + (HF_TRAINER,) else "torchtune"


@dataclass(frozen=True)
class Profile:
    """Everything a benchmark run holds fixed."""

    name: str
    groups: Tuple[Group, ...]
    device: str = "cpu"
    dtype: str = "fp32"
    batch_size: int = 1          # per process
    max_seq_len: int = 256
    steps: int = 4               # optimizer steps per run
    skip_steps: int = 1          # excluded from the step-time statistics
    repeats: int = 3
    warmup: bool = True          # one discarded short run per recipe first
    run_timeout_s: int = 900
    pad_to: Optional[int] = None  # pad every micro-batch to this many tokens (fixed shapes)
    extra_overrides: Tuple[str, ...] = field(default_factory=tuple)
    report: str = "standard"  # or "realistic": the tables and targets of bench.report's realistic section

    def cases(self) -> List[Case]:
        return [Case(g, v) for g in self.groups for v in g.variants]

    def batch_size_of(self, group: Group) -> int:
        """Micro-batch size per process of ``group`` (samples)."""
        return group.batch_size if group.batch_size is not None else self.batch_size

    def max_seq_len_of(self, group: Group) -> int:
        """``tokenizer.max_seq_len`` of ``group`` (tokens)."""
        return group.max_seq_len if group.max_seq_len is not None else self.max_seq_len


def _groups(kind: str, nproc: int, gas: Sequence[int], variants: Sequence[str] = VARIANTS) -> List[Group]:
    return [Group(kind, nproc, ga, tuple(variants)) for ga in gas]


PROFILES: Dict[str, Profile] = {
    # The default CPU benchmark: throughput, about 40 minutes on an idle 2-core CPU.
    "cpu": Profile(
        name="cpu",
        groups=tuple(
            _groups("full", 1, (1, 4)) + _groups("lora", 1, (1, 4))
            + _groups("full", 2, (1, 4)) + _groups("lora", 2, (4,))
        ),
        steps=3,
    ),
    # Peak memory against accumulation steps, one device, GA 1 and 8, every
    # micro-batch padded to the same length (otherwise the longest sample a
    # run happens to draw decides its peak): about 10 minutes.
    "memory": Profile(
        name="memory",
        groups=tuple(_groups("full", 1, (1, 8)) + _groups("lora", 1, (1, 8))),
        steps=3, repeats=1, pad_to=256,
    ),
    # Two processes at GA 8, full fine-tune, one repeat: the distributed end of the
    # accumulation range, kept out of the default profile for time (about 10 minutes).
    "dist_ga8": Profile(
        name="dist_ga8",
        groups=tuple(_groups("full", 2, (8,))),
        steps=3, repeats=1,
    ),
    # A smoke check of every code path: one repeat, 3 steps, under 5 minutes.
    "quick": Profile(
        name="quick",
        groups=tuple(_groups("full", 1, (1,)) + _groups("full", 2, (2,), (UPSTREAM, OURS_EACH))),
        steps=3, repeats=1, warmup=False,
    ),
    # One CUDA device, bf16: fits in 10 minutes on an H100/H200-class GPU.
    "gpu": Profile(
        name="gpu",
        groups=tuple(_groups("full", 1, (1, 8))),
        device="cuda", dtype="bf16", batch_size=4, max_seq_len=1024, steps=12, skip_steps=3, repeats=2,
        warmup=True, run_timeout_s=240,
    ),
}


# Realistic settings (issue 13): 32 samples per optimizer step in every group of
# the 8 x 4 x 512 family (8 x GA 4 on one device, 4 x GA 4 on each of 2 processes).
_REALISTIC_1DEV = (UPSTREAM, OURS_ONCE, OURS_EACH, OURS_UNGROUPED, OURS_ONCE_DEVICE)
REALISTIC_GROUPS = (
    Group("full", 1, 4, _REALISTIC_1DEV + (HF_TRAINER, OURS_PACKED, OURS_PACKED_2048), batch_size=8, max_seq_len=512,
          tag="b8"),
    Group("lora", 1, 4, _REALISTIC_1DEV, batch_size=8, max_seq_len=512, tag="b8"),
    Group("full", 2, 4, (UPSTREAM, OURS_ONCE, OURS_UNGROUPED, OURS_ONCE_DEVICE, OURS_PACKED), batch_size=4,
          max_seq_len=512, tag="b4"),
    # the HF Trainer at the benchmark's usual batch 1 (there grouping changes nothing;
    # a token budget lets the step's samples share a micro-batch)
    Group("full", 1, 4, (OURS_ONCE, OURS_BUDGET, OURS_PACKED, HF_TRAINER, OURS_ONCE_DEVICE), batch_size=1,
          max_seq_len=256, tag="b1"),
)
PROFILES["realistic"] = Profile(
    name="realistic", groups=REALISTIC_GROUPS, batch_size=8, max_seq_len=512,
    steps=3, skip_steps=1, repeats=1, warmup=False, run_timeout_s=1800, report="realistic",
)
# The same on one CUDA device in bf16, one device only (bench/gpu_bench.sh --realistic).
PROFILES["gpu_realistic"] = Profile(
    name="gpu_realistic",
    groups=(Group("full", 1, 4, _REALISTIC_1DEV, batch_size=8, max_seq_len=512, tag="b8"),),
    device="cuda", dtype="bf16", batch_size=8, max_seq_len=512, steps=12, skip_steps=3, repeats=2,
    warmup=True, run_timeout_s=240, report="realistic",
)


# Issue 30: the transformers path against the torchtune path, our recipe on both, SmolLM2-135M.
# The shipped single-device config's sizes (batch 2 x GA 4, 512 tokens), both backward per
# micro-batch (what backward: auto runs there); 5 steps, the first 2 left out of the statistics.
_TRANSFORMERS_PAIR = (OURS_EACH, OURS_HF_EACH)
PROFILES["hf"] = Profile(
    name="hf", groups=(Group("full", 1, 4, _TRANSFORMERS_PAIR, batch_size=2, max_seq_len=512),),
    batch_size=2, max_seq_len=512, steps=5, skip_steps=2, repeats=3, warmup=True, report="hf",
)
# Its smoke check (about 2 minutes on an idle 2-core CPU): batch 1 x GA 2, 128 tokens, one repeat.
PROFILES["hf_quick"] = Profile(
    name="hf_quick", groups=(Group("full", 1, 2, _TRANSFORMERS_PAIR, batch_size=1, max_seq_len=128),),
    batch_size=1, max_seq_len=128, steps=3, skip_steps=1, repeats=1, warmup=False, report="hf",
)


def with_overrides(profile: Profile, **changes) -> Profile:
    """The profile with some fields replaced (None values are ignored)."""
    return replace(profile, **{k: v for k, v in changes.items() if v is not None})


def run_overrides(case: Case, profile: Profile, output_dir: Path, steps: Optional[int] = None) -> List[str]:
    """``key=value`` overrides that make one run of ``case`` (both implementations take the same keys)."""
    overrides = [
        f"output_dir={output_dir}",
        f"batch_size={profile.batch_size_of(case.group)}",
        f"gradient_accumulation_steps={case.group.ga}",
        "epochs=1",
        f"max_steps_per_epoch={steps or profile.steps}",
        f"tokenizer.max_seq_len={profile.max_seq_len_of(case.group)}",
        # upstream seeds its sampler with 0 whatever the config says: the same
        # seed gives ours the same samples in the same order
        f"seed={SEED}",
        f"device={profile.device}",
        f"dtype={profile.dtype}",
        "log_every_n_steps=1",
        "clip_grad_norm=1.0",
        "compile=false",
        "enable_activation_checkpointing=false",
        "resume_from_checkpoint=false",
        # the whole demo file, as upstream's bench configs read it (the shipped configs hold out
        # the last 50 records for validation)
        "dataset.split=train",
    ]
    if case.impl == "ours":
        overrides += [
            *VARIANT_OVERRIDES[case.variant],
            "save_final_checkpoint=false",
            # the benchmark times training steps only (the shipped configs validate before and after)
            "run_val_every_n_steps=null",
            "run_val_at_start=false",
            # the same metric backend as upstream's configs (its extra keys are ignored by DiskLogger)
            "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
        ]
    return overrides + list(profile.extra_overrides)


def _leaves(node: Dict[str, Any], prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf of a nested dict."""
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _override_value(value: Any) -> str:
    """``value`` as torchtune's command line reads it back (OmegaConf's YAML parse of a dotlist)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    return str(value)


def _config_leaves(path: str) -> Dict[str, Any]:
    return dict(_leaves(OmegaConf.to_container(OmegaConf.load(REPO / path), resolve=False)))


def transformers_path_overrides(kind: str) -> List[str]:
    """``key=value`` overrides that make ``TRANSFORMERS_CONFIGS[kind]`` train as our torchtune config does.

    ``model_dir`` is the folder the torchtune config's checkpointer reads (the
    same weights), and every key outside :data:`MODEL_KEYS` whose value differs
    (the tokenizer, whose chat template SmolLM2's folder would otherwise add a
    system prompt with; the warm-up steps; ...) takes the torchtune config's
    value, so both runs see the same token ids and the same schedule.

    Raises:
        ValueError: the transformers config has a key the torchtune config
            lacks (outside :data:`MODEL_KEYS`): a setting only one path would get.
    """
    _, ours = RECIPES[("ours", kind, False)]
    theirs = TRANSFORMERS_CONFIGS[kind]
    mine, hf = _config_leaves(ours), _config_leaves(theirs)

    def aligned(key: str) -> bool:
        return key.split(".")[0] not in MODEL_KEYS

    extra = sorted(k for k in hf if aligned(k) and k not in mine)
    if extra:
        raise ValueError(f"{theirs} sets {', '.join(extra)}, which {ours} does not: add them there, or to MODEL_KEYS "
                         "if they belong to the model")
    overrides = [f"model_dir={mine['checkpointer.checkpoint_dir']}"]
    overrides += [f"{key}={_override_value(value)}" for key, value in mine.items()
                  if aligned(key) and (key not in hf or hf[key] != value)]
    return overrides


def command(case: Case, profile: Profile, output_dir: Path, steps: Optional[int] = None,
            python: str = sys.executable) -> List[str]:
    """The command line of one run, to start from the repository root."""
    if case.impl == "hf":
        if case.group.kind != "full" or case.group.nproc != 1:
            raise ValueError(f"{case.name}: the HF Trainer baseline is a full fine-tune on one device")
        _, config = RECIPES[("ours", "full", False)]
        return [python, "-m", "bench.hf_trainer", "--out", str(output_dir / "probe.json"), "--config", config,
                *run_overrides(case, profile, output_dir, steps)]
    recipe, config = RECIPES[(case.impl, case.group.kind, case.group.nproc > 1)]
    aligned: List[str] = []
    if case.model_path == "transformers":
        if case.group.nproc != 1:
            raise ValueError(f"{case.name}: the transformers path is benchmarked on one device")
        config, aligned = TRANSFORMERS_CONFIGS[case.group.kind], transformers_path_overrides(case.group.kind)
    launch_args = ["--out", str(output_dir / "probe.json")]
    if case.impl == UPSTREAM:
        launch_args.append("--upstream")
        if case.group.kind == "lora":
            # upstream draws its initial adapter from another random stream than ours
            # (bench.launch.OurInitialAdapter): start it from ours, so the losses compare the steps
            launch_args += ["--adapter-seed", str(SEED)]
    if profile.pad_to:
        launch_args += ["--pad-to", str(profile.pad_to)]
    run = run_overrides(case, profile, output_dir, steps)
    given = {o.split("=", 1)[0] for o in run}
    aligned = [o for o in aligned if o.split("=", 1)[0] not in given]  # the run sets these for both paths
    args = [*launch_args, recipe, "--config", config, *aligned, *run]
    if case.group.nproc == 1:
        return [python, "-m", "bench.launch", *args]
    # As `tune run --nproc_per_node N` does: torchrun in standalone mode, one process per rank.
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={case.group.nproc}",
            "bench/launch.py", *args]
