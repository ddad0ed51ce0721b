"""The profile as text: a summary, the top modules at each depth, the module tree with each MoE
layer's dispatch, combine and expert load; and DeepSpeed's number-to-string helpers (K, M, G, T;
s, ms, us), which DeepSpeed users call on their own."""

from collections.abc import Iterator

from megatron.profiling.records import ModuleProfile, MoEProfile, PhaseProfile, ProfileHeader

_PREFIXES = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3), ("", 1.0))
_TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6))


def number_to_string(num: float, units: str | None = None, precision: int = 2) -> str:
    """1234567 -> "1.23 M": the largest of T, G, M, K that keeps the number at least 1, or `units`
    ("" for none)."""
    scale = dict(_PREFIXES)
    if units is not None and units not in scale:
        raise ValueError(f"units {units!r} is not one of T, G, M, K or ''")
    prefix = units if units is not None else next((p for p, s in _PREFIXES if abs(num) >= s), "")
    if not prefix and float(num).is_integer():  # counts below 1000 as they are: "512", not "512.00"
        return str(int(num))
    return f"{num / scale[prefix]:.{precision}f} {prefix}".rstrip()


def flops_to_string(flops: float, units: str | None = None, precision: int = 2) -> str:
    """A rate: 8.19e13 -> "81.90 TFLOPS" (floating-point operations per second)."""
    return _with_suffix(number_to_string(flops, units, precision), "FLOPS")


def macs_to_string(macs: float, units: str | None = None, precision: int = 2) -> str:
    """3.14e9 -> "3.14 GMACs"."""
    return _with_suffix(number_to_string(macs, units, precision), "MACs")


def params_to_string(params: float, units: str | None = None, precision: int = 2) -> str:
    """336230000 -> "336.23 M"."""
    return number_to_string(params, units, precision)


def duration_to_string(duration: float, units: str | None = None, precision: int = 2) -> str:
    """Seconds as s, ms or us: 0.07667 -> "76.67 ms"."""
    scale = dict(_TIME_UNITS)
    if units is not None and units not in scale:
        raise ValueError(f"units {units!r} is not one of s, ms or us")
    unit = units if units is not None else next((u for u, s in _TIME_UNITS if duration >= s), "us")
    return f"{duration / scale[unit]:.{precision}f} {unit}"


def _with_suffix(number: str, suffix: str) -> str:
    """ "1.23 G" + "MACs" -> "1.23 GMACs"; "12" + "MACs" -> "12 MACs"."""
    return f"{number}{suffix}" if number[-1].isalpha() else f"{number} {suffix}"


def profile_text(
    root: ModuleProfile, header: ProfileHeader, module_depth: int, top_modules: int, detailed: bool
) -> str:
    """What print_model_profile prints. `module_depth` -1 reaches every depth."""
    deepest = max(depth for depth, _ in _walk(root)) if module_depth < 0 else module_depth
    lines = _summary(root, header) + _rank_lines(header) + _top_modules(root, deepest, top_modules)
    if detailed:
        lines += ["", "Modules (params, MACs, FLOPs = GEMM + other, fwd latency, FLOP/s; % of the model's):"]
        lines += _tree_lines(root, root, "", 0, deepest)
    return "\n".join(lines)


def _summary(root: ModuleProfile, header: ProfileHeader) -> list[str]:
    cost, factor = root.cost, header.recompute_fwd_factor
    rows: list[tuple[str, str]] = []
    if header.grid is not None:
        g = header.grid
        rows.append(("world size", str(g.world_size)))
        rows.append(
            (
                "data / tensor / pipeline / expert parallel size",
                f"{g.dp_size} / {g.tp_size} / {g.pp_size} / {g.ep_size}",
            )
        )
    if header.gradient_accumulation_steps is not None:
        rows.append(("gradient accumulation steps", str(header.gradient_accumulation_steps)))
    rows += [
        ("params (this rank's)", params_to_string(root.params)),
        ("fwd MACs", macs_to_string(cost.macs)),
        ("fwd FLOPs", number_to_string(cost.flops)),
        (
            "  of which GEMM (2 x MACs) / other",
            f"{number_to_string(cost.gemm_flops)} / {number_to_string(cost.other_flops)}",
        ),
        ("fwd latency", duration_to_string(root.duration_s)),
        ("fwd FLOP/s = fwd FLOPs / fwd latency", flops_to_string(_rate(cost.flops, root.duration_s))),
        (f"fwd+bwd FLOPs, estimated as (3 + {factor:g}) x fwd", number_to_string((3 + factor) * cost.flops)),
    ]
    if header.times is not None:
        step_s = header.times.iteration_s
        rows += [
            ("bwd + optimizer step latency", duration_to_string(max(step_s - root.duration_s, 0.0))),
            ("iteration latency (profiling included)", duration_to_string(step_s)),
            ("iteration FLOP/s, from the estimate", flops_to_string(_rate((3 + factor) * cost.flops, step_s))),
            ("samples/second", f"{_rate(header.times.samples, step_s):.2f}"),
        ]
    width = max(len(label) for label, _ in rows) + 2
    title = f" Flops profile at step {header.step} "
    notation = (
        "MACs: multiply-accumulates of matrix products and attention; FLOPs: 2 per MAC (GEMM) plus 1 per "
        "element of elementwise, normalisation, softmax and reduction ops (other); latency: wall time"
    )
    return [title.center(100, "-"), notation, ""] + [f"{label + ':':<{width}}{value}" for label, value in rows]


def _rank_lines(header: ProfileHeader) -> list[str]:
    """Every rank's part of the step, their sum and the slowest rank (the one the others wait for)."""
    ranks = header.times.ranks if header.times is not None else ()
    if len(ranks) < 2:
        return []
    lines = ["", "Every rank's part (params and FLOPs of its own modules; replicas each counted):"]
    lines.append(f"{'rank':>6}{'params':>14}{'fwd FLOPs':>14}{'fwd latency':>14}{'iteration':>14}")
    for r in ranks:
        lines.append(
            f"{r.rank:>6}{params_to_string(r.params):>14}{number_to_string(r.fwd_flops):>14}"
            f"{duration_to_string(r.fwd_latency_s):>14}{duration_to_string(r.iteration_s):>14}"
        )
    params, flops = sum(r.params for r in ranks), sum(r.fwd_flops for r in ranks)
    lines.append(f"{'sum':>6}{params_to_string(params):>14}{number_to_string(flops):>14}")
    slowest, fastest = max(ranks, key=lambda r: r.iteration_s), min(ranks, key=lambda r: r.iteration_s)
    lines.append(
        f"slowest rank: {slowest.rank}, iteration {duration_to_string(slowest.iteration_s)} "
        f"({_percent(slowest.iteration_s - fastest.iteration_s, fastest.iteration_s)} above the fastest, rank "
        f"{fastest.rank}); slowest forward: rank {max(ranks, key=lambda r: r.fwd_latency_s).rank}"
    )
    return lines


def _top_modules(root: ModuleProfile, deepest: int, top: int) -> list[str]:
    lines = ["", f"Top {top} modules by params, MACs and fwd latency at each depth:"]
    by_depth: dict[int, list[ModuleProfile]] = {}
    for depth, module in _walk(root):
        by_depth.setdefault(depth, []).append(module)
    for depth in range(min(deepest, max(by_depth)) + 1):
        modules = by_depth[depth]
        lines.append(f"depth {depth}:")
        for label, key, show in (
            ("params", lambda m: m.params, params_to_string),
            ("MACs", lambda m: m.cost.macs, macs_to_string),
            ("fwd latency", lambda m: m.duration_s, duration_to_string),
        ):
            best = sorted(modules, key=key, reverse=True)[:top]
            lines.append(f"    {label:<12}- " + ", ".join(f"{_label(m)}: {show(key(m))}" for m in best))
    return lines


def _walk(module: ModuleProfile, depth: int = 0) -> Iterator[tuple[int, ModuleProfile]]:
    yield depth, module
    for child in module.children:
        yield from _walk(child, depth + 1)


def _label(module: ModuleProfile) -> str:
    return f"{module.name} ({module.kind})" if module.name else module.kind


def _tree_lines(module: ModuleProfile, root: ModuleProfile, indent: str, depth: int, deepest: int) -> list[str]:
    short = module.name.rsplit(".", 1)[-1]
    name = f"({short}) {module.kind}" if module.name else module.kind
    calls = f" x {module.calls} calls" if module.calls > 1 else ""
    lines = [f"{indent}{name}: {_module_stats(module, root)}{calls}"]
    if depth == deepest:
        return lines
    inner = indent + "  "
    moe = module.moe
    for child in module.children:
        if moe is not None and child.kind == "GroupedExperts":
            lines.append(inner + _phase_line("[dispatch] sort, permutation, all-to-all", moe.dispatch, root))
        lines += _tree_lines(child, root, inner, depth + 1, deepest)
        if moe is not None and child.kind == "GroupedExperts":
            lines += [inner + "  " + line for line in _load_lines(moe, child)]
            lines.append(inner + _phase_line("[combine] return all-to-all, gate-weighted sum", moe.combine, root))
    return lines


def _module_stats(module: ModuleProfile, root: ModuleProfile) -> str:
    cost = module.cost
    return (
        f"{params_to_string(module.params)} params ({_percent(module.params, root.params)}), "
        f"{macs_to_string(cost.macs)}, "
        f"{number_to_string(cost.flops)} FLOPs ({_percent(cost.flops, root.cost.flops)}; "
        f"GEMM {number_to_string(cost.gemm_flops)} + other {number_to_string(cost.other_flops)}), "
        f"{duration_to_string(module.duration_s)} ({_percent(module.duration_s, root.duration_s)}), "
        f"{flops_to_string(_rate(cost.flops, module.duration_s))}"
    )


def _phase_line(label: str, phase: PhaseProfile, root: ModuleProfile) -> str:
    cost = phase.cost
    return (
        f"{label}: {macs_to_string(cost.macs)}, {number_to_string(cost.flops)} FLOPs "
        f"({_percent(cost.flops, root.cost.flops)}), {duration_to_string(phase.duration_s)} "
        f"({_percent(phase.duration_s, root.duration_s)})"
    )


def _load_lines(moe: MoEProfile, experts: ModuleProfile) -> list[str]:
    routed, received, active = moe.routed_per_expert, moe.received_per_expert, moe.active_gemm_flops
    # the experts' GEMMs may run over more rows than they received (the CPU experts' padded blocks)
    beyond = experts.cost.gemm_flops - sum(active)
    return [
        f"routed choices per expert (before capacity drops): {routed} = {sum(routed)}",
        f"rows per local expert: {received} = {sum(received)}",
        f"active GEMM FLOPs per local expert (its rows x 2 x {moe.macs_per_row} MACs): "
        f"[{', '.join(number_to_string(f) for f in active)}]; GEMM FLOPs run beyond them: {number_to_string(beyond)}",
    ]


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "0.00%"


def _rate(flops: float, seconds: float) -> float:
    return flops / seconds if seconds > 0 else 0.0
