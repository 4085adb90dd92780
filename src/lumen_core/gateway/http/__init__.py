"""The OpenAI-compatible front door: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/v1/resume``, ``/health`` and ``/metrics`` over HTTP or HTTPS (FastAPI on uvicorn), in the
gateway's process.

``FrontDoor`` serves an app (``app.build_app``) that admits each client request through the
gateway's ``Coordinator`` and streams the tokens the coordinator keeps for it, so a stream goes
on across a worker's failure. Needs the ``lumen_core[http]`` extra (docs/front_door.md).
"""
