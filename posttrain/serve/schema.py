"""The OpenAPI schema describes the request bodies the endpoints read themselves.

The endpoints read their bodies raw and validate them with the SDK's own request models (so a malformed
body is a 400 naming the model and the fields, after the API key is checked), which FastAPI cannot see.
`json_body(Model)` tells the schema (as `openapi_extra`), `install` adds the models' JSON schemas as
components and the X-API-Key scheme, so clients and tools (schemathesis in tests/serve) know each body.
"""

from __future__ import annotations

from typing import Any

import pydantic
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"


class Bodies:
    def __init__(self) -> None:
        self.models: list[type[pydantic.BaseModel]] = []

    def json(self, model: type[pydantic.BaseModel]) -> dict[str, Any]:
        """`openapi_extra` for an endpoint whose body is `model` as JSON."""
        if model not in self.models:
            self.models.append(model)
        schema = {"$ref": REF.format(model=model.__name__)}
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}

    @staticmethod
    def protobuf(message: str) -> dict[str, Any]:
        """`openapi_extra` for an endpoint whose body is the protobuf message `message`."""
        schema = {"type": "string", "format": "binary", "description": f"tinker_public.{message}"}
        return {"requestBody": {"required": True, "content": {"application/x-protobuf": {"schema": schema}}}}

    def install(self, app: FastAPI) -> None:
        def openapi() -> dict[str, Any]:
            if app.openapi_schema is None:
                schema = get_openapi(
                    title=app.title, version=app.version, description=app.description, routes=app.routes
                )
                _, defs = models_json_schema([(m, "validation") for m in self.models], ref_template=REF)
                components = schema.setdefault("components", {})
                components.setdefault("schemas", {}).update(defs.get("$defs", {}))
                components["securitySchemes"] = {
                    "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"}
                }
                schema["security"] = [{"apiKey": []}]
                app.openapi_schema = schema
            return app.openapi_schema

        app.openapi = openapi  # type: ignore[method-assign]
