"""Where the dashboard's events come from when it runs no engine: a recorded list or an
events.jsonl played back (``replay``), another process's run followed as it writes
(``follow``), on their shared base (``stream``); and what a dead run left behind
(``postmortem``), read from its run folder before anything new arrives."""
