"""posttrain.session_router."""

__all__: list[str] = []
