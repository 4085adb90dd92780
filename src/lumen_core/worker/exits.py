"""Exit statuses of ``lumen worker`` and ``lumen agent``, one home for both (supervisors and
tests read them)."""

EXIT_OK = 0
EXIT_FENCED = 3  # the lease was lost and no registration succeeded within the holder linger
EXIT_SERVER_EXITED = 4  # ``lumen agent`` only: its vLLM server exited
