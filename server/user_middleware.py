"""`--middleware`: a deployment's own ASGI middleware, named by import path as vLLM's flag names
it. A class is added as ASGI middleware (built with the app it wraps); an async function
`(request, call_next)` wraps every HTTP request as FastAPI's `@app.middleware("http")` does.
A path that does not import, or names neither, stops the start with the reason."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, cast

from fastapi import FastAPI


def resolve(path: str) -> Any:
    """The object `path` (`package.module.name`) names."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"--middleware {path!r}: give a module and a name, as package.module.name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--middleware {path!r}: cannot import {module_name}: {exc}") from exc
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"--middleware {path!r}: {module_name} has no {name}") from None


def add_user_middleware(app: FastAPI, paths: tuple[str, ...]) -> None:
    """Add each named middleware, the first given innermost (as vLLM adds them, in order)."""
    for path in paths:
        found = resolve(path)
        if inspect.isclass(found):
            app.add_middleware(cast(Any, found))
        elif inspect.iscoroutinefunction(found):
            app.middleware("http")(found)
        else:
            raise ValueError(
                f"--middleware {path!r}: neither an ASGI middleware class nor an async "
                "function (request, call_next)"
            )
