"""Errors a user can act on. The server maps them to OpenAI-shaped HTTP errors."""


class JaxServeError(Exception):
    """Base class."""


class InvalidRequestError(JaxServeError, ValueError):
    """Bad input, found before the request enters the queue (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class QueueFullError(JaxServeError):
    """The waiting queue is at --max-waiting-requests (HTTP 429)."""


class EngineDeadError(JaxServeError):
    """The engine loop died; no new request can be served (HTTP 500/503)."""


class ModelLoadError(JaxServeError):
    """A model could not be loaded: missing file, bad shape, corrupt checkpoint, unsupported architecture."""


class ReplicaLostError(EngineDeadError):
    """A data-parallel replica died: the requests it held (``request_ids``) failed; the other replicas serve on."""

    def __init__(self, message: str, request_ids: list[str]):
        super().__init__(message)
        self.request_ids = list(request_ids)
