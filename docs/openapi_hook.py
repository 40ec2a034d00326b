"""MkDocs hook: the page holding `<!-- openapi -->` gets trio-nsqd's OpenAPI document (what GET
/openapi.json answers) rendered as Markdown, made from the same code at build time, so the page cannot
drift from the broker. Named in mkdocs.yml's `hooks`."""

from __future__ import annotations

from typing import Any

MARKER = "<!-- openapi -->"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _schema(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if "enum" in schema:
        return " | ".join(f"`{v}`" for v in schema["enum"])
    kind = schema.get("type", "")
    return f"{kind} ({schema['format']})" if "format" in schema else kind


def render(spec: dict[str, Any]) -> str:
    """The paths of an OpenAPI 3 document as Markdown: per endpoint its summary, parameters and answers."""
    out = [f"trio-nsqd {spec['info']['version']} answers `GET /openapi.json` with this document "
           f"(OpenAPI {spec['openapi']}); this page is made from it when the site is built.", ""]
    for path, methods in spec["paths"].items():
        shared = methods.get("parameters") or []  # parameters every method of the path takes
        for method, op in methods.items():
            if method not in ("get", "post", "put", "delete", "patch", "head"):
                continue
            out += [f"## `{method.upper()} {path}`", ""]
            if op.get("summary"):
                out += [op["summary"], ""]
            if op.get("description"):
                out += [op["description"], ""]
            params = shared + (op.get("parameters") or [])
            if params:
                out += ["| parameter | in | required | type | description |", "| --- | --- | --- | --- | --- |"]
                out += [f"| `{p['name']}` | {p['in']} | {'yes' if p.get('required') else ''} | "
                        f"{_cell(_schema(p.get('schema', {})))} | {_cell(p.get('description', ''))} |" for p in params]
                out.append("")
            body = op.get("requestBody")
            if body:
                kinds = ", ".join(f"`{k}`" for k in body.get("content", {}))
                described = _cell(body.get("description", ""))
                out += [f"Body ({kinds}){': ' + described if described else ''}", ""]
            out += ["| status | answer |", "| --- | --- |"]
            out += [f"| {status} | {_cell(r.get('description', ''))} |" for status, r in op.get("responses", {}).items()]
            out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    from trio_nsq.broker.http.openapi import openapi_spec
    return markdown.replace(MARKER, render(openapi_spec()))
