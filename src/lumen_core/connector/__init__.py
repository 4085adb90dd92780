"""The engine-neutral connector core (docs/connector.md): one request-lifecycle API that an
engine adapter maps its hooks onto: begin a request with its grant, save a step, durable
length, plan and run a verified restore, finish. Capabilities are opaque bytes throughout."""

from lumen_core.connector.core import ConnectorCore, RestoreOutcome
from lumen_core.connector.fingerprint import model_fingerprint
from lumen_core.connector.lookup import RestoreLookup
from lumen_core.connector.requests import Address, RestoreSource, StepTokens, StreamGrant
from lumen_core.connector.sources import SourceReader

__all__ = [
    "Address",
    "ConnectorCore",
    "RestoreLookup",
    "RestoreOutcome",
    "RestoreSource",
    "SourceReader",
    "StepTokens",
    "StreamGrant",
    "model_fingerprint",
]
