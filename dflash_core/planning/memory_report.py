"""The memory plan for people: a fixed-width table in GiB, one column per group of identical
devices, and for each group that does not fit, one line saying what to change."""

from __future__ import annotations

from dflash_core.planning.memory import Overflow, Plan, device_groups, device_key
from dflash_core.units import GiB


def format_plan(plan: Plan) -> str:
    """Fixed-width table in GiB: one column per group of identical devices, then a verdict."""
    groups = device_groups(plan.rows)
    names: list[str] = []
    for _, r in groups:
        names += [n for n in r.components if n not in names]
    heads = [_group_label(devs) for devs, _ in groups]
    width = max([10] + [len(h) + 2 for h in heads])
    label_w = max(len(n) for n in names + ["memory plan (GiB)"]) + 2

    def line(label: str, cells: list[str]) -> str:
        return label.ljust(label_w) + "".join(c.rjust(width) for c in cells)

    out = [line("memory plan (GiB)", heads), line("role", [r.role for _, r in groups])]
    for n in names:
        out.append(line(n, [_gib(r.components[n]) if n in r.components else "-"
                            for _, r in groups]))
    out.append(line("total", [_gib(r.total) for _, r in groups]))
    out.append(line("free", [_gib(r.free) for _, r in groups]))
    out.append(line("headroom", [_gib(r.headroom) if r.headroom is not None else "-"
                                 for _, r in groups]))
    out.append(line("fits", ["yes" if r.fits else f"NO +{_gib(r.total - r.free)}"
                             for _, r in groups]))
    drafters = [("drafter" in r.role) for _, r in groups]
    if any(drafters):
        # where a drafter pass peaks, and whether its layers are kept for backward
        out.append(line("drafter peak", [plan.drafter_peak if d else "-" for d in drafters]))
        out.append(line("drafter layers", [("recomputed" if plan.recompute else "kept")
                                           if d else "-" for d in drafters]))
        if plan.without_recompute is not None:  # drafter.recompute auto turned it on
            out.append(line("total if kept", [_gib(plan.without_recompute) if d else "-"
                                            for d in drafters]))
    out.append(f"full target logits would add {_gib(plan.logits_extra)} GiB per target GPU"
               f" (+{_gib(plan.logits_upcast_extra)} GiB more if upcast to float32 for a loss);"
               " the engine never computes them")
    if plan.fits:
        out.append("plan fits")
    else:
        out.append("plan does NOT fit:")
        out += [f"  {format_overflow(o)}" for o in plan.overflows]
    return "\n".join(out)


def format_overflow(overflow: Overflow) -> str:
    """One line for people: what does not fit where, and the options, biggest lever first."""
    row = overflow.row
    lowered = [f"{k} (now {v})" for k, v in overflow.lower]
    options = []
    if lowered:
        options.append("lower " + (", ".join(lowered[:-1]) + " or " if len(lowered) > 1 else "")
                       + lowered[-1])
    if overflow.recompute:
        options.append("recompute the drafter's layers in backward (drafter.recompute: on, "
                       "or auto)")
    if overflow.separate_roles:
        options.append("put targets and drafters on different GPUs (layout.targets, "
                       "layout.drafters)")
    if overflow.weights_too_big:
        options.append("use devices with more memory: the weights alone do not fit")
    return (f"{_group_label(overflow.devices)} ({row.role}) needs {_gib(row.total)} GiB but has"
            f" {_gib(row.free)} GiB free: " + "; or ".join(options))


def _gib(nbytes: int | None) -> str:
    return "?" if nbytes is None else f"{nbytes / GiB:.1f}"


def _group_label(devices: list[str]) -> str:
    """cuda:0..6 for a contiguous run, else a comma list."""
    if len(devices) == 1:
        return devices[0]
    idx = [device_key(d)[1] for d in devices]
    kind = device_key(devices[0])[0]
    if idx == list(range(idx[0], idx[0] + len(idx))):
        return f"{kind}:{idx[0]}..{idx[-1]}"
    return f"{kind}:" + ",".join(map(str, idx))
