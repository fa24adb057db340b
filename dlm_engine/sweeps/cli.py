"""Aggregation of a sweep directory -- at the end of a multirun (:class:`AggregateCallback`) and as the
``dlm-sweep DIR`` command for partial or failed sweeps."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

try:  # Hydra is a dependency; the fallback keeps this module importable without it
    from hydra.experimental.callback import Callback as _HydraCallback
except Exception:  # pragma: no cover
    _HydraCallback = object

from dlm_engine.app.jobs import ERROR, MAX_PRINTED_ROWS, RESULT, VIZ_HINT
from dlm_engine.sweeps.plots import write_plots
from dlm_engine.sweeps.scan import scan
from dlm_engine.sweeps.tables import markdown_table, rows_from_jobs, varying, write_csv

def not_started(root: Path, jobs) -> Union[List[Dict[str, Any]], str]:
    """Jobs of the sweep's grid (its ``multirun.yaml``) that have no directory yet: an interrupted sweep never
    started them. A note instead when the grid cannot be read or job directories are named otherwise."""
    from omegaconf import OmegaConf

    from dlm_engine.sweeps.grid import read_grid
    from dlm_engine.app.jobs import job_dirname

    path = Path(root) / "multirun.yaml"
    if not path.is_file():
        return []
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        if "dlm_job_dir" not in str(((raw.get("hydra") or {}).get("sweep") or {}).get("subdir")):
            return "jobs that never started are not listed (hydra.sweep.subdir is not the dlm default)"
        grid = read_grid(root)
    except Exception as exc:  # the jobs' own results are still aggregated
        return f"jobs that never started are not listed: multirun.yaml could not be expanded ({exc})"
    seen = {j.get("_dir") for j in jobs}
    return [{"status": "not started", "overrides": job, "_dir": job_dirname(job)}
            for job in grid or [] if job_dirname(job) not in seen]


def aggregate(root: Path, plots: bool = True, out=None) -> Dict[str, Any]:
    """Scan ``root`` and write ``sweep.csv``, ``sweep.md`` and the plots there; prints a summary."""
    from dlm_engine.fsutil import atomic_write_bytes

    out = out or sys.stdout
    root = Path(root)
    jobs = [j for j in scan(root)]
    unplanned = not_started(root, jobs)
    jobs += unplanned if isinstance(unplanned, list) else []
    rows, settings, metric_cols, swept = rows_from_jobs(jobs)
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    report = {"jobs": len(rows), "counts": counts, "files": [], "notes": [] if isinstance(unplanned, list) else [unplanned]}
    if not rows:
        print(f"dlm-sweep: no jobs under {root} (looked for {RESULT}, {ERROR} and .hydra/ directories)", file=out)
        return report
    cols = ["job", "status"] + settings + [c for c in metric_cols if c in ("trace_path", "trace_digest", "error")
                                            or any(r.get(c) is not None for r in rows)]
    write_csv(root / "sweep.csv", rows, cols)
    ok = [r for r in rows if r["status"] == "ok"]
    shown_settings = varying(rows, swept) or settings[:1]
    shown = shown_settings + [c for c in ("accuracy", "nfe_per_prompt", "tpf", "tps", "pareto")
                              if any(r.get(c) is not None for r in ok)]
    if len(counts) > 1 or "ok" not in counts:
        shown = ["status"] + shown
    table = markdown_table(rows, shown)
    atomic_write_bytes(str(root / "sweep.md"), table.encode())
    report["files"] += [root / "sweep.csv", root / "sweep.md"]
    if plots:
        try:
            files, notes = write_plots(rows, swept, root)
            report["files"] += files
            report["notes"] += notes
        except ImportError:
            report["notes"].append(f"plots skipped: matplotlib is not installed ({VIZ_HINT})")
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    print(f"sweep {root}: {len(rows)} jobs ({summary})", file=out)
    lines = table.splitlines()
    if len(lines) > 2 + MAX_PRINTED_ROWS:  # large sweeps: the files have every row
        lines = lines[:2 + MAX_PRINTED_ROWS] + [f"... {len(lines) - 2 - MAX_PRINTED_ROWS} more rows in sweep.md"]
    print("\n".join(lines), file=out)
    for f in report["files"]:
        print(f"wrote {f}", file=out)
    for n in report["notes"]:
        print(n, file=out)
    bad = [r for r in rows if r["status"] != "ok"]
    for r in bad:
        print(f"{r['status']}: {r['job']}" + (f": {r['error']}" if r.get("error") else ""), file=out)
    if bad:
        print(f"{len(bad)} job(s) without a result; re-run the same command with hydra.sweep.dir={root} "
              f"to run only those", file=out)
    out.flush()
    return report


def check_before_launch(config) -> None:
    """Compose and validate every job of the sweep before the first one starts; on problems, list them all
    (one line per job) and exit 2 without running any job."""
    from dlm_engine.sweeps.grid import check_jobs, swept_part

    n, problems = check_jobs(config)
    if not problems:
        return
    print(f"dlm: error: {len(problems)} of {n} jobs of the sweep have invalid configs (no job was run):",
          file=sys.stderr)
    for job, message in problems:
        print(f"  {swept_part(job, [j for j, _ in problems])}: {message}", file=sys.stderr)
    sys.stderr.flush()
    sys.exit(2)


class AggregateCallback(_HydraCallback):
    """Hydra callback: says what a resumed sweep will skip, aggregates the sweep directory at the end.

    Configured by ``conf/hydra/callbacks/sweep.yaml``. It keeps no state: the end-of-multirun step scans
    the result files, like ``dlm-sweep DIR`` (which covers sweeps that failed and never reach the end).
    """

    def __init__(self, plots: bool = True):
        self.plots = plots

    def on_multirun_start(self, config, **kwargs) -> None:
        check_before_launch(config)
        root = Path(str(config.hydra.sweep.dir))
        done = sum(1 for j in scan(root) if j.get("status") == "ok") if root.is_dir() else 0
        if done and not bool(config.get("resume", True)):
            print(f"dlm: sweep {root}: {done} finished job(s) found; resume=false re-runs them", flush=True)
        elif done:
            print(f"dlm: resuming sweep {root}: {done} finished job(s) found (result.json); jobs with the same "
                  f"overrides and config are skipped (resume=false re-runs them)", flush=True)
        else:
            print(f"dlm: sweep dir {root} (re-run with hydra.sweep.dir={root} to resume)", flush=True)

    def on_multirun_end(self, config, **kwargs) -> None:
        root = Path(str(config.hydra.sweep.dir))
        try:
            report = aggregate(root, plots=self.plots)
        except Exception as exc:  # the jobs' results are safe on disk; do not fail the sweep here
            print(f"dlm: sweep aggregation failed ({type(exc).__name__}: {exc}); run `dlm-sweep {root}`",
                  file=sys.stderr, flush=True)
            return
        failed = report["counts"].get("failed", 0)
        if failed:  # jobs with a user error returned normally so the others could run: exit non-zero here
            print(f"dlm: error: {failed} job(s) of the sweep failed (error.json in their directories)",
                  file=sys.stderr, flush=True)
            sys.exit(1)


# --------------------------------------------------------------------------------------- dlm-sweep
def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="dlm-sweep",
        description="Aggregate a (partial or failed) `dlm -m` sweep directory: scans every job's result.json "
                    "and writes sweep.csv, sweep.md and plots (accuracy_vs_nfe.png, tps.png) into DIR.")
    ap.add_argument("dir", metavar="DIR", help="the sweep directory (hydra.sweep.dir)")
    ap.add_argument("--no-plots", action="store_true", help="write only the tables")
    args = ap.parse_args(argv)
    root = Path(args.dir)
    if not root.is_dir():
        print(f"dlm-sweep: error: {root} is not a directory", file=sys.stderr)
        return 2
    try:
        report = aggregate(root, plots=not args.no_plots)
    except BrokenPipeError:  # `dlm-sweep DIR | head`: the files are written before the table is printed
        return 0
    except OSError as exc:  # a read-only or full sweep directory: the path and the errno text
        from dlm_engine.fsutil import os_error_message

        print(f"dlm-sweep: error: {os_error_message(exc, root)}", file=sys.stderr)
        return 2
    # 0 only for a complete sweep: failed, incomplete, never started or stale jobs make it exit 1
    return 0 if report["jobs"] and set(report["counts"]) == {"ok"} else 1


if __name__ == "__main__":
    sys.exit(main())
