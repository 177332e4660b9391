"""Imported at the start of every Python process whose ``PYTHONPATH`` holds this folder
(test_one_route.py): with ``MEGAINFER_ROUTE_LOG`` set, every request an engine core takes in
(``EngineCore.handle`` of an ``AddRequest``) is appended to that file as one JSON line: the
process, the engine the core drives, the request id."""
import os

if os.environ.get("MEGAINFER_ROUTE_LOG"):
    import json

    from megainfer.engine_core import core as _core
    from megainfer.engine_core.messages import AddRequest

    _handle = _core.EngineCore.handle

    def _logged(self, msg):
        if isinstance(msg, AddRequest):
            with open(os.environ["MEGAINFER_ROUTE_LOG"], "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "engine": type(self.engine).__name__,
                                    "entry": "EngineCore.handle",
                                    "request_id": msg.request_id}) + "\n")
        return _handle(self, msg)

    _core.EngineCore.handle = _logged
