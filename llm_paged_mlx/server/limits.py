"""A limit on request bodies, before anything reads them."""

from typing import Callable


class BodySizeLimit:
    """ASGI middleware: a body over ``limit`` bytes (declared or sent) gets ``error(message)`` instead of the app.

    The body is read here, then handed to the app; later ``receive`` calls (a
    client's disconnect) pass through.
    """

    def __init__(self, app, limit: int, error: Callable[[str], object]):
        self.app, self.limit, self.error = app, limit, error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"the request body is larger than {self.limit} bytes"
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.limit:
            return await self.error(message if declared.isdigit() else "bad Content-Length header")(scope, receive, send)
        body, more = b"", True
        while more:
            part = await receive()
            if part["type"] == "http.disconnect":
                return
            body += part.get("body", b"")
            more = part.get("more_body", False)
            if len(body) > self.limit:
                return await self.error(message)(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
