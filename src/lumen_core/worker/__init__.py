"""Worker processes of a live cluster: the reference engine driven by the gateway, with
checkpoint streaming, an embedded holder and the restore path (``lumen worker``); and the
agent that makes one vLLM server such a worker (``lumen agent``, ``agent``)."""

# A 32B model in bf16 (64 GB) and a 0.6B draft (1.2 GB) read from one NVMe drive at 3.5 GB/s:
# the load times a restarted worker of the paper's setup waits for. Modelled, not measured.
MODELLED_FULL_LOAD_S = 64e9 / 3.5e9
MODELLED_DRAFT_LOAD_S = 1.2e9 / 3.5e9
