"""The exception a failed moe-server call raises."""


class ServerError(RuntimeError):
    """A call to moe-server (or the client library's own check before it) failed.

    ``code`` is the gRPC status code's name ("INVALID_ARGUMENT", "NOT_FOUND",
    "RESOURCE_EXHAUSTED", "UNAVAILABLE", ...) and ``message`` the message, which names the
    offending field for bad input (docs/PROTOCOL.md, "Errors").
    """

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self):
        return (type(self), (self.code, self.message))
