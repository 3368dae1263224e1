"""What a run leaves for the tools that read it without loading JAX (sweep, report): the names
of its files and the entry point's exit statuses. Imports nothing."""

# A run stopped by SIGTERM or a preemption notice saved its state and is not finished:
# the entry point exits with this status (EX_TEMPFAIL) so schedulers and retry loops rerun it.
EXIT_PREEMPTED = 75
# A single-process run stopped by a first Ctrl-C saved its state too; 130 = 128 + SIGINT, as shells report it.
EXIT_INTERRUPTED = 130


FINAL_METRICS = "final_metrics.json"
RUN_RECORD = "sweep_run.json"  # the command a sweep last trained a run folder with (a folder it started)
HISTORY = "history.jsonl"  # one JSON line per record: {"step": s, "<prefix>_<name>": value, ...}
