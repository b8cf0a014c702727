"""The event-loop glue: the native bridge (``native``), the completion engine (``engine``) and the
asyncio/trio backends it watches the agent's wake fd with (``backends``)."""
