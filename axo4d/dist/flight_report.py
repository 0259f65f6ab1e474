"""Comparing the ranks' collective traces (:mod:`axo4d.dist.flight`): who is behind, and where.

Every member of a process group enters that group's collectives in the same order, so a group's
sequence numbers line up across its ranks. A collective that a rank waits in (``waiting`` in its
trace) and that another member never entered (its ``last_seq`` on that group is lower, or it wrote
no trace at all: stopped, hung or dead) names the rank that is behind. The collective waited in
since the earliest time is the first that went wrong; what is stuck after it follows from it.
Pure functions of the traces (unit-tested without processes).
"""

from __future__ import annotations

import time


def _members(traces: dict[int, dict], group: str, rank: int) -> list[int]:
    return traces[rank].get("groups", {}).get(group, [rank])


def _where(t: dict) -> str:
    w = t.get("waiting")
    if not w:
        return "not waiting in a collective"
    members = t.get("groups", {}).get(w["group"], [])
    return f"waits in {w['op']} #{w['seq']} over {w['group']} (group ranks {members})"


def stuck_collectives(traces: dict[int, dict], world: int) -> list[dict]:
    """Each collective some rank waits in: ``{group, ranks, seq, op, since, waiting, absent, behind}``,
    earliest first (``absent``: members without a trace; ``behind``: members that never entered it)."""
    out: dict[tuple, dict] = {}
    for r, t in traces.items():
        w = t.get("waiting")
        if not w:
            continue
        members = _members(traces, w["group"], r)
        key = (w["group"], tuple(members), w["seq"])
        e = out.setdefault(
            key,
            {"group": w["group"], "ranks": members, "seq": w["seq"], "op": w["op"], "since": w["start"], "waiting": []},
        )
        e["waiting"].append(r)
        e["since"] = min(e["since"], w["start"])
    for (g, members, s), e in out.items():
        e["absent"] = [m for m in members if m not in traces and 0 <= m < world]
        e["behind"] = [m for m in members if m in traces and traces[m].get("last_seq", {}).get(g, 0) < s]
        e["waiting"].sort()
    return sorted(out.values(), key=lambda e: (e["since"], e["group"], e["seq"]))


def diagnose(traces: dict[int, dict], world: int) -> list[str]:
    """Lines naming the rank that is behind, the group and the sequence number it stopped at, then
    what else is stuck (module docstring)."""
    if not traces:
        return ["no rank wrote a trace"]
    missing = [r for r in range(world) if r not in traces]
    stuck = stuck_collectives(traces, world)
    lines: list[str] = []
    named = False
    for i, e in enumerate(stuck):
        head = f"{e['op']} #{e['seq']} over {e['group']} (group ranks {e['ranks']})"
        since = time.strftime("%H:%M:%S", time.localtime(e["since"]))
        who = f"rank {e['waiting'][0]}" if len(e["waiting"]) == 1 else f"ranks {e['waiting']}"
        if not e["absent"] and not e["behind"]:
            if i == 0:
                lines.append(
                    f"every member entered {head}, which {who} waits in since {since}: a rank died inside it, "
                    "or the network failed"
                )
            continue
        parts = []
        for m in e["absent"]:
            parts.append(f"rank {m} never entered it (rank {m} wrote no trace: stopped, hung or dead)")
        for m in e["behind"]:
            last = traces[m].get("last_seq", {}).get(e["group"], 0)
            parts.append(f"rank {m} never entered it (its last there: #{last}; rank {m} {_where(traces[m])})")
        culprits = e["absent"] + e["behind"]
        lead = (
            f"rank {culprits[0]} is behind" if len(culprits) == 1 else f"ranks {culprits} are behind"
        ) + f" on {e['group']} at #{e['seq']}: "
        text = f"{head}, waited in by {who} since {since}: " + "; ".join(parts)
        lines.append(f"also stuck: {text}" if named else lead + text)
        named = True
    if not lines:
        lines.append("no rank is waiting in a collective (the failure was not a hang)")
    if missing:
        lines.append(f"no trace from rank(s) {missing} (stopped, hung or dead, or ended before writing one)")
    return lines


def table(traces: dict[int, dict], world: int) -> str:
    """One row per group and member: the last collective entered and completed, and what it waits in."""
    groups: dict[tuple, str] = {}
    for r, t in traces.items():
        for g, members in t.get("groups", {}).items():
            groups[(g, tuple(members))] = g
    now = max((t.get("time", 0.0) for t in traces.values()), default=time.time())
    rows = [("group", "ranks", "rank", "last entered", "last completed", "state")]
    for (g, members), _ in sorted(groups.items(), key=lambda kv: (len(kv[0][1]), kv[0][0], kv[0][1])):
        for m in members:
            t = traces.get(m)
            if t is None:
                rows.append((g, str(list(members)), str(m), "-", "-", "no trace (stopped, hung or dead)"))
                continue
            recs = [x for x in t.get("records", []) if x["group"] == g]
            done = [x for x in recs if x["end"] is not None]
            last = recs[-1] if recs else None
            entered = f"#{t.get('last_seq', {}).get(g, 0)}" + (f" {last['op']} {last['bytes']} B" if last else "")
            completed = f"#{done[-1]['seq']}" if done else ("-" if recs else "(before the buffer)")
            w = t.get("waiting")
            state = (
                f"WAITING in #{w['seq']} {w['op']} for {now - w['start']:.1f} s"
                if w and w["group"] == g and tuple(t["groups"].get(g, [])) == members
                else ""
            )
            rows.append((g, str(list(members)), str(m), entered, completed, state))
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


__all__ = ["diagnose", "stuck_collectives", "table"]
