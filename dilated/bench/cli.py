"""The options every benchmark script shares: sizes and lists, the parser whose usage errors are one
line and exit 2, YAML configs checked like the command line, the checks no option type can make,
``--quick``, and the run options they give (the results file and the report: :mod:`.output`)."""
from __future__ import annotations

import argparse
import copy
import math
import os

import yaml

from .runner import RunOptions
from .sizes import LARGEST_SIZE, parse_size, size_list  # noqa: F401  (the options' types)

DTYPES = ("bfloat16", "float16", "float32", "float64")
MODES = ("fwd", "bwd", "fwd_bwd")
LONGNET_SEGMENTS = (2048, 4096, 8192, 16384, 32768)
LONGNET_DILATIONS = (1, 2, 4, 8, 16)


def int_list(text) -> list[int]:
    if isinstance(text, (list, tuple)):
        text = ",".join(map(str, text))
    try:
        values = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of whole numbers: {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"give positive whole numbers, e.g. 1,4: got {text!r}")
    return values


def str_list(text) -> list[str]:
    if isinstance(text, (list, tuple)):
        items = [str(t).strip() for t in text]
    else:
        items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items or not all(items):
        raise argparse.ArgumentTypeError(f"an empty list: {text!r}")
    return items


def float_list(text) -> list[float]:
    if isinstance(text, (list, tuple)):
        text = ",".join(map(str, text))
    items = [t for t in str(text).split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"an empty list: {text!r}")
    return [positive_float(t) for t in items]


def positive_int(text) -> int:
    return _number(text, int, lambda v: v >= 1, "a whole number >= 1")


def nonnegative_int(text) -> int:
    return _number(text, int, lambda v: v >= 0, "a whole number >= 0")


def positive_float(text) -> float:
    return _number(text, float, lambda v: v > 0, "a finite number > 0")


def nonnegative_float(text) -> float:
    return _number(text, float, lambda v: v >= 0, "a finite number >= 0")


def _number(text, kind, ok, what):
    try:
        if isinstance(text, bool) or (kind is int and isinstance(text, float) and not text.is_integer()):
            raise ValueError  # a YAML 2.5 is refused as the command line's "2.5" is, not truncated
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}")
    return value


class BenchParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr and exit status 2.
    ``several_devices``: the script runs each configuration on each of a list of ``--device``."""

    several_devices = False

    def error(self, message):  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message}\n")


def usage_error(p: argparse.ArgumentParser, message: str):
    """Exit 2 with one line naming the option (the same as argparse's own usage errors)."""
    p.error(message)


def default_schedule(n: int, segments=LONGNET_SEGMENTS, dilations=LONGNET_DILATIONS) -> tuple[tuple[int, ...],
                                                                                         tuple[int, ...]]:
    """LongNet's schedule w = 2048..32768, r = 1..16 (or ``segments`` and ``dilations``), keeping the
    branches that fit in N; for N below the first segment a scaled one (N/4, N/2, N with r = 1, 2, 4)."""
    if n >= segments[0]:
        keep = [(w, r) for w, r in zip(segments, dilations) if w <= n]
    else:
        keep = [(max(1, n // 4), 1), (max(1, n // 2), 2), (n, 4)]
        keep = [(w, r) for w, r in keep if r <= w]
    return tuple(w for w, _ in keep), tuple(r for _, r in keep)


def add_common_args(p: argparse.ArgumentParser, *, seq_lengths="8192", batch=2, heads=8, head_dim=64,
                    mode="fwd", dtype=None) -> None:
    g = p.add_argument_group("problem")
    g.add_argument("--batch-size", type=positive_int, default=batch)
    g.add_argument("--seq-lengths", type=size_list, default=seq_lengths, help="comma list; accepts 8k, 1M")
    g.add_argument("--num-heads", type=positive_int, default=heads)
    g.add_argument("--num-kv-heads", type=positive_int, default=None, help="GQA: fewer k/v heads")
    g.add_argument("--head-dim", type=positive_int, default=head_dim)
    g.add_argument("--segment-lengths", type=size_list, default=None, help="default: LongNet's, clipped to N")
    g.add_argument("--dilation-rates", type=size_list, default=None)
    g.add_argument("--causal", action="store_true")
    g.add_argument("--dtype", default=dtype, choices=DTYPES,
                   help="bfloat16 (GPU default), float32 (CPU default), float16, float64")
    g.add_argument("--mode", type=str_list, default=mode, help="fwd, bwd, fwd_bwd (comma list)")
    g.add_argument("--backend", type=str_list, default="auto", help="attention backend(s), comma list")
    g.add_argument("--input-scales", type=float_list, default=[1.0],
                   help="stability scenario: q and k (a module's input) multiplied by each of these (logits by its "
                        "square), e.g. 0.01,0.1,1,10,100,1e4; each row records its error against float64 and the "
                        "non-finite values of its output")
    g.add_argument("--inputs", default=None, metavar="DIR",
                   help="captured tensors: a directory of .pt files, each a dict of q, k, v [B, N, H, D] "
                        "(or x [B, N, E] for modules), loaded with weights_only; shapes come from the files")
    t = p.add_argument_group("measurement")
    t.add_argument("--warmup", type=nonnegative_int, default=3,
                   help="warm-up calls, the first included; on a GPU at least 2 (DILATED_CUDNN_BUILD_AFTER): a "
                        "shape's cuDNN graph is built at its second call, which is then never a timed one")
    t.add_argument("--warmup-s", type=nonnegative_float, default=None,
                   help="warm up for at least this many seconds too (default 1 on a GPU, 0 on CPU: a GPU held at "
                        "its power cap lowers its clocks within a row's first second; each GPU row records them)")
    t.add_argument("--reps", type=positive_int, default=10)
    t.add_argument("--rep-s", type=nonnegative_float, default=None,
                   help="time calls for at least this many seconds too (default 1 on a GPU, 0 on CPU: the median "
                        "then spans a power-capped GPU's clock swings, so that repeats of a config agree)")
    t.add_argument("--time-budget", type=positive_float, default=None,
                   help="at most about this many seconds per row: warm-up and timed calls stop once it is spent "
                        "(at least one timed call; where calls exceed it, the row's warm-up calls are still made "
                        "and its one sample is the last of them, so a first call that compiles is never a "
                        "row's only sample unless --warmup is below 2 on a CPU)")
    t.add_argument("--no-check", action="store_true", help="skip the correctness check of each row")
    t.add_argument("--check-determinism", action="store_true",
                   help="run each configuration twice more on the same inputs and record whether its output and "
                        "gradients are bit-identical (row field 'determinism')")
    t.add_argument("--profile", default=None, metavar="DIR",
                   help="write a torch profiler trace (Chrome/Perfetto JSON) of one more call per row to DIR, "
                        "named after the row")
    t.add_argument("--cuda-graph", action="store_true",
                   help="time CUDA-graph replays of fwd and fwd_bwd rows and their --floor (no host time; "
                        "each row's cuda_graph says whether it was)")
    t.add_argument("--no-l2-flush", action="store_true")
    t.add_argument("--floor", action="store_true",
                   help="dilated rows: also time the kernel floor (the kernels alone on pre-gathered segments)")
    t.add_argument("--settle-s", type=nonnegative_float, default=0.0,
                   help="idle this many seconds before each row's timed calls, so that a GPU slowed by the row "
                        "before (clocks, temperature) recovers; each row records the GPU's state around its timing")
    t.add_argument("--memory-budget-mib", type=positive_float, default=None, help="record rows above this peak as oom")
    t.add_argument("--seed", type=nonnegative_int, default=0)
    t.add_argument("--device", default=None,
                   help="cpu, cuda, cuda:1 (default: cuda if available); benchmark_implementations and "
                        "benchmark_backends take several (cpu,cuda): each configuration on each, and the report "
                        "gives the GPU's speed-up over the CPU")
    o = p.add_argument_group("output")
    o.add_argument("--config", default=None, help="YAML file of argument values (safe-loaded)")
    o.add_argument("--quick", action="store_true",
                   help="a small preset that finishes fast: a smoke run (few lengths and calls, no time-based "
                        "warm-up or repetition), not numbers to report")
    o.add_argument("--output", default=None, help="JSONL path (default results/<device>/<script>-<time>.jsonl); "
                   "an existing file is refused unless --append is given")
    o.add_argument("--append", action="store_true", help="append rows to an existing --output file")
    o.add_argument("--csv", action="store_true", help="also write a CSV next to the JSONL")
    o.add_argument("--plot", action="store_true", help="also write PNG plots")
    o.add_argument("--baseline", default=None, help="implementation[/backend] for speed-ups")
    o.add_argument("--no-progress", action="store_true")


def given_options(p: argparse.ArgumentParser, argv) -> set[str]:
    """The destinations the command line sets (abbreviated or ``--opt=value`` forms included)."""
    quiet = copy.deepcopy(p)
    for a in quiet._actions:
        a.default = argparse.SUPPRESS
    return set(vars(quiet.parse_args(argv)))


def _config_value(p, action, key, value, path):
    """A YAML value checked like the command line would check it; usage error otherwise."""
    where = f"--config {path}: {key}"
    if value is None:  # YAML null (or an empty value): the option's default, where that is "not set"
        if action.default is None or action.default is argparse.SUPPRESS:
            return None
        usage_error(p, f"{where} is null (empty): give a value, or remove the line to keep the default "
                       f"{action.default!r}")
    if action.nargs == 0:  # store_true / store_false flags take a YAML boolean, nothing else
        if not isinstance(value, bool):
            usage_error(p, f"{where} must be true or false (a YAML boolean, unquoted), got {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(value, dict) or isinstance(value, bool):
        usage_error(p, f"{where}: expected a value like the command line's, got {value!r}")
    numeric = action.type in (positive_int, nonnegative_int, positive_float, nonnegative_float, int, float)
    if numeric and isinstance(value, str):
        usage_error(p, f"{where} must be a number, got the string {value!r}")
    if isinstance(value, list):
        value = ",".join(map(str, value))
    try:
        value = action.type(value) if action.type is not None else str(value)
    except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
        usage_error(p, f"{where}: {e}")
    if action.choices is not None and value not in action.choices:
        usage_error(p, f"{where}: invalid choice {value!r} (choose from {', '.join(map(str, action.choices))})")
    return value


def parse_with_config(p: argparse.ArgumentParser, argv=None, implementations: list[str] | None = None,
                      rejected: dict[str, str] | None = None) -> argparse.Namespace:
    """Parse, then apply ``--config`` YAML values for options not given on the command line, each
    checked as the command line checks it; then :func:`check_args`. ``args.given`` is the set of
    options the user set (command line or file). ``rejected``: options this script accepts from
    the shared set but cannot honour, with the reason: setting one is a usage error."""
    args = p.parse_args(argv)
    given = given_options(p, argv)
    if args.config:
        try:
            with open(args.config) as f:
                data = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as e:
            usage_error(p, f"--config {args.config}: cannot read YAML: {str(e).splitlines()[0]}")
        if not isinstance(data, dict):
            usage_error(p, f"--config {args.config}: expected a mapping of option: value, got {type(data).__name__}")
        known = {a.dest: a for a in p._actions if a.option_strings}
        for key, value in data.items():
            dest = str(key).replace("-", "_")
            if dest not in known or dest in ("config", "help"):
                usage_error(p, f"--config {args.config}: unknown option {key!r}")
            if dest in given:  # the command line wins
                continue
            setattr(args, dest, _config_value(p, known[dest], key, value, args.config))
            given.add(dest)
    args.given = given
    for dest, why in (rejected or {}).items():
        if dest in given:
            usage_error(p, f"--{dest.replace('_', '-')}: {why}")
    check_args(p, args, implementations)
    return args


def check_args(p: argparse.ArgumentParser, args, implementations: list[str] | None = None) -> None:
    """Usage errors the option types cannot see: names that must be known (``implementations``:
    the ones this script runs), combinations."""
    from dilated.backends import backend_names

    from .registry import implementation_names

    for dest in ("mode",):
        for m in getattr(args, dest, None) or []:
            if m not in MODES:
                usage_error(p, f"--mode: unknown mode {m!r} (choose from {', '.join(MODES)})")
    for dest in ("backend", "backends"):
        known = backend_names()
        for b in getattr(args, dest, None) or []:
            if b not in known:
                usage_error(p, f"--{dest}: unknown backend {b!r} (choose from {', '.join(known)})")
    for dest in ("implementations", "implementation"):
        known = implementations if implementations is not None else implementation_names()
        for name in getattr(args, dest, None) or []:
            if name not in known:
                usage_error(p, f"--{dest}: unknown implementation {name!r} here (choose from {', '.join(known)})")
    for d in getattr(args, "dtypes", None) or []:
        if d not in DTYPES:
            usage_error(p, f"--dtypes: unknown dtype {d!r} (choose from {', '.join(DTYPES)})")
    if getattr(args, "device", None) is not None:
        _check_devices(p, args.device)
    heads, kv = getattr(args, "num_heads", None), getattr(args, "num_kv_heads", None)
    if heads and kv and heads % kv:
        usage_error(p, f"--num-kv-heads {kv} must divide --num-heads {heads}")
    segs, dils = getattr(args, "segment_lengths", None), getattr(args, "dilation_rates", None)
    if dils and not segs:
        usage_error(p, "--dilation-rates needs --segment-lengths (one rate per segment length)")
    if segs and dils and len(segs) != len(dils):
        usage_error(p, f"--dilation-rates has {len(dils)} entries, --segment-lengths {len(segs)}: give one rate "
                       "per segment length")
    for w, r in zip(segs or [], dils or []):
        if r > w:
            usage_error(p, f"--dilation-rates: rate {r} is above its segment length {w} (a segment of w rows at "
                           "rate r keeps w / r of them: give r <= w)")
    baseline = getattr(args, "baseline", None)
    if baseline:
        known = implementations if implementations is not None else implementation_names()
        name, _, backend = baseline.partition("/")
        if name not in known or (backend and backend not in backend_names()):
            usage_error(p, f"--baseline {baseline!r}: name an implementation this script runs, optionally with "
                           f"/backend (implementations: {', '.join(known)})")
    profile = getattr(args, "profile", None)
    if profile:
        try:
            os.makedirs(profile, exist_ok=True)
        except OSError as e:
            usage_error(p, f"--profile {profile}: cannot make the directory for the traces ({e.strerror})")
    if getattr(args, "append", False) and not getattr(args, "output", None):
        usage_error(p, "--append needs --output FILE")
    output = getattr(args, "output", None)
    writer = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0  # only rank 0 writes rows
    if writer and output and os.path.exists(output) and not getattr(args, "append", False):
        usage_error(p, f"--output {output} exists; give --append to add rows to it, or another path")
    if output and not output.endswith(".jsonl"):
        usage_error(p, f"--output {output}: results are JSON lines; name the file *.jsonl")


def _check_devices(p, text: str) -> None:
    import torch

    names = text.split(",")
    if len(names) > 1 and not getattr(p, "several_devices", False):
        usage_error(p, f"--device {text}: this script runs on one device; give one (cpu, cuda or cuda:N)")
    seen = set()
    for name in names:
        try:
            dev = torch.device(name)
        except (RuntimeError, TypeError):
            usage_error(p, f"--device: not a device: {name!r} (use cpu, cuda or cuda:N)")
        if (dev.type, dev.index or 0) in seen:
            usage_error(p, f"--device {text}: one device named twice")
        seen.add((dev.type, dev.index or 0))
        if dev.type not in ("cpu", "cuda"):
            usage_error(p, f"--device: {name!r}: the harness runs on cpu or cuda")
        if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
            usage_error(p, f"--device {name}: no such CUDA device here "
                           f"({torch.cuda.device_count()} visible); use --device cpu")


def runs_on_gpus(argv) -> bool:
    """Whether a script's defaults are a GPU's: ``--device`` (on the command line, else in the
    ``--config`` file) names only CUDA devices, or it is not given and CUDA is available
    (``--device cpu`` on a GPU host gets the CPU's lengths and head sizes)."""
    import sys

    import torch

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device")
    pre.add_argument("--config")
    given = pre.parse_known_args(sys.argv[1:] if argv is None else argv)[0]
    device = given.device
    if device is None and given.config:
        try:
            with open(given.config) as f:
                data = yaml.safe_load(f)
            device = data.get("device") if isinstance(data, dict) else None
        except (OSError, yaml.YAMLError):
            pass  # the parser reports it
    if isinstance(device, str) and device:
        return all(d.strip().startswith("cuda") for d in device.split(","))
    return torch.cuda.is_available()


def devices_of(args) -> list:
    """The devices of ``--device``, in order (``[None]``: the default one)."""
    return args.device.split(",") if args.device else [None]


def apply_quick(args, **preset) -> None:
    """``--quick``: the preset values for the options the user did not set; a smoke run, so no
    time-based warm-up or repetition either (on a GPU they default to a second each per row)."""
    if getattr(args, "quick", False):
        for dest, value in {"warmup_s": 0.0, "rep_s": 0.0, **preset}.items():
            if dest not in args.given:
                setattr(args, dest, value)


def run_options(args, device: str | None = None) -> RunOptions:
    """The measurement options of ``args`` (on ``device``, default ``--device``'s one device)."""
    return RunOptions(warmup=args.warmup, reps=args.reps, budget_s=args.time_budget, check=not args.no_check,
                      cuda_graph=args.cuda_graph, flush_l2=not args.no_l2_flush,
                      memory_budget_mib=args.memory_budget_mib, seed=args.seed, device=device or args.device,
                      floor=args.floor, settle_s=args.settle_s, warmup_s=args.warmup_s,
                      rep_s=args.rep_s, check_determinism=args.check_determinism, profile_dir=args.profile)


def default_dtype(args) -> str:
    import torch

    if args.dtype:
        return args.dtype
    devices = [d or ("cuda" if torch.cuda.is_available() else "cpu") for d in devices_of(args)]
    # float32 when any device is a CPU: rows of one configuration on each device compare
    return "bfloat16" if all(d.startswith("cuda") for d in devices) else "float32"
