"""``aiockpt prune``: what a retention policy would delete, and partial saves; deleted with
``--yes``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from .._core import format as fmt
from .._core.lease import GONE, Claimant, read_current, supersedes
from .._core.pruning import held_files, plan_prune
from ..retention import (
    AnyOf,
    BestN,
    CheckpointRecord,
    EveryNSeconds,
    EveryNSteps,
    LatestN,
    RetentionPolicy,
)
from .args import Parser, positive_int, positive_seconds
from .common import Root, UsageError, open_root, require_checkpoints, require_exists, scan
from .output import format_time, human_bytes, plural

#: The line of ``aiockpt --help`` that names the command.
HELP = "delete checkpoints a policy does not keep, and partial saves"
#: What ``aiockpt prune --help`` says it does.
DESCRIPTION = (
    "Show what a retention policy would delete (kept: any checkpoint one of the --keep "
    "options keeps, and always the newest); delete it with --yes. Without --keep options every "
    "checkpoint is kept and only partial step directories go."
)


def add_arguments(p: Parser) -> None:
    """The arguments of ``prune``."""
    p.add_argument("--keep-last", metavar="N", type=positive_int, help="keep the N newest")
    p.add_argument("--keep-every", metavar="K", type=positive_int, help="keep steps divisible by K")
    p.add_argument(
        "--keep-every-seconds",
        metavar="S",
        type=positive_seconds,
        help="keep the first checkpoint committed in each S-second window",
    )
    p.add_argument(
        "--keep-best",
        metavar="METRIC:MODE:N",
        type=best_spec,
        action="append",
        default=[],
        help="keep the N best by METRIC, MODE min or max; repeatable",
    )
    p.add_argument(
        "--all-partials",
        action="store_true",
        help="also remove partial step directories at or above the newest commit "
        "(only when no save is running)",
    )
    p.add_argument("--yes", action="store_true", help="delete; without it, only show")
    p.add_argument(
        "--force",
        action="store_true",
        help="delete even while a writer holds the root's lease (it may be saving into it)",
    )
    p.set_defaults(func=run)


def best_spec(text: str) -> BestN:
    """``METRIC:MODE:N``, e.g. ``loss:min:2`` (the metric name may itself contain colons)."""
    parts = text.rsplit(":", 2)
    if len(parts) != 3 or not parts[0]:
        raise argparse.ArgumentTypeError(f"expected METRIC:MODE:N such as loss:min:2, not {text!r}")
    metric, mode, n = parts
    if mode not in ("min", "max"):
        raise argparse.ArgumentTypeError(f"MODE must be min or max, not {mode!r} (in {text!r})")
    return BestN(positive_int(n), metric, mode)  # type: ignore[arg-type]


def keep_policy(args: argparse.Namespace) -> RetentionPolicy | None:
    """The policy of prune's ``--keep`` options: any of them keeps; None without any."""
    parts: list[RetentionPolicy] = []
    if args.keep_last is not None:
        parts.append(LatestN(args.keep_last))
    if args.keep_every is not None:
        parts.append(EveryNSteps(args.keep_every))
    if args.keep_every_seconds is not None:
        parts.append(EveryNSeconds(args.keep_every_seconds))
    parts.extend(args.keep_best)
    return AnyOf(*parts) if parts else None


def require_metrics(best: Sequence[BestN], records: Sequence[CheckpointRecord]) -> None:
    """A --keep-best metric that no checkpoint has is a mistake (a typo would otherwise plan
    to delete all but the newest checkpoint). Checkpoints that lack a metric some others have
    are never counted as best by it."""
    present = {name for r in records for name in r.metrics}
    for policy in best:
        if policy.metric not in present:
            there = ", ".join(sorted(present)) or "none"
            raise UsageError(
                f"no checkpoint has the metric {policy.metric!r} of --keep-best "
                f"(metrics there: {there})"
            )


def refuse_if_leased(root: Root) -> None:
    """A usage error while a writer holds the root's lease: its manager may be saving and
    applying its own retention, and deleting under it is how checkpoints get lost."""
    lease = read_current(root.catalog.storage)
    holder = lease.holder(time.time())
    # A holder proven gone (its processes dead, on this host) saves nothing any more.
    if holder is not None and supersedes(Claimant.here(), holder)[0] != GONE:
        raise UsageError(
            f"{root.url} is leased by a running writer ({holder.describe()}); deleting "
            "while it saves can remove what it is writing. Stop it first, or pass --force"
        )


def run(args: argparse.Namespace) -> int:
    """``aiockpt prune``: what the policy would delete, and partial saves; deleted with --yes
    (a checkpoint's manifest first, so a deletion cut short never leaves a broken step)."""
    policy = keep_policy(args)
    root = scan(open_root(args.root, args.storage_options), args.root)
    require_exists(root)
    if args.yes and not args.force:
        refuse_if_leased(root)
    if not root.committed and not (args.all_partials and root.partials):
        require_checkpoints(root)
    records = []
    for e in root.committed:
        if e.manifest is None:  # never deleted on a guess; verify says what is wrong
            print(f"keeping step {e.step}: its manifest is unreadable ({e.error})", file=sys.stderr)
        else:
            records.append(CheckpointRecord(e.step, e.manifest.created_at, e.manifest.metrics))
            # What it reads from other steps' files: the catalog keeps those files.
            root.catalog.note_refs(e.step, e.manifest.referenced_files())
    require_metrics(args.keep_best, records)
    step_dirs = {e.step: True for e in root.committed} | dict.fromkeys(root.partials, False)
    plan = plan_prune(policy, records, step_dirs, everything=args.all_partials)
    doomed = set(plan.doomed)

    out = sys.stdout
    verb = "deleting" if args.yes else "would delete"
    for e in root.committed:
        if e.step in doomed and e.manifest is not None:
            m = e.manifest
            out.write(
                f"{verb} step {e.step} (committed {format_time(m.created_at)}, "
                f"{human_bytes(m.nbytes)})\n"
            )
            if args.yes:
                root.catalog.delete_step(e.step)
    # Files that the kept steps read from (incremental checkpoints) stay, whatever their
    # directory; None: a kept manifest is unreadable, so no file is known to be unread.
    unreadable = {e.step for e in root.committed if e.manifest is None}
    kept_refs = None if unreadable & set(plan.kept) else root.catalog.referenced(plan.kept)
    for step in plan.partials:
        dirname = fmt.step_dirname(step)
        held = None if kept_refs is None else held_files(kept_refs, step)
        if held is None:
            out.write(f"keeping step directory {dirname}: a kept manifest is unreadable\n")
            continue
        if held:
            out.write(
                f"keeping retired step directory {dirname}: kept steps read from "
                f"{plural(len(held), 'file')} of it\n"
            )
        else:
            out.write(f"{verb} partial step directory {dirname}\n")
        if args.yes:
            root.catalog.sweep(step, kept_refs)
    if plan.spared:
        print(
            f"left partial step directories at or above the newest commit (a save may still be "
            f"writing them; --all-partials removes them too): {', '.join(map(str, plan.spared))}",
            file=sys.stderr,
        )
    kept = plan.kept
    out.write(f"keeping {plural(len(kept), 'checkpoint')}: {', '.join(map(str, kept)) or '-'}\n")
    if not doomed and not plan.partials:
        print("nothing to delete", file=sys.stderr)
    elif not args.yes:
        print("dry run: nothing was deleted; pass --yes to delete", file=sys.stderr)
    return 0
