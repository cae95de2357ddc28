"""A fake Hugging Face Hub at huggingface_hub's HTTP layer (the ``fake_hub`` fixture): what loopvq-push sends
is recorded, never sent over the network; shared by the push tests (tests/bundle/test_hub*.py)."""

from __future__ import annotations

import base64
import importlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import _http

HTTP = importlib.import_module(HfHubHTTPError.__mro__[1].__module__)  # httpx (hub 1.x) or httpx2 (hub 2.x)


class FakeHub:
    """The hub's HTTP API as huggingface_hub's client reaches it: repo creation, branches, the card's YAML check,
    preupload (every file 'regular', so its bytes travel in the commit) and commits; records every request and
    each commit's files."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.created: list[dict[str, Any]] = []
        self.commits: list[dict[str, Any]] = []
        self.fail: Callable[[Any], Any] | None = None  # request -> a response that replaces the normal one, or None

    def handle(self, request: Any) -> Any:
        self.requests.append((request.method, request.url.path))
        answer = self.fail(request) if self.fail is not None else None  # a failure, or None: answer normally
        if answer is not None:
            return answer
        route = request.url.path
        if route == "/api/repos/create":
            self.created.append({**json.loads(request.content), "auth": request.headers.get("authorization")})
            return HTTP.Response(200, json={"url": "https://huggingface.co/org/x"})
        if route == "/api/validate-yaml":  # hub 2.x checks a README.md's front matter before committing it
            return HTTP.Response(200, json={"errors": [], "warnings": []})
        if "/branch/" in route:
            return HTTP.Response(200, json={})
        if "/preupload/" in route:
            files = json.loads(request.content)["files"]
            return HTTP.Response(
                200,
                json={"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]},
            )
        if "/commit/" in route:
            lines = [json.loads(line) for line in request.content.decode().splitlines() if line.strip()]
            files = {
                line["value"]["path"]: base64.b64decode(line["value"]["content"])
                for line in lines
                if line["key"] == "file"
            }
            other = [line["key"] for line in lines if line["key"] not in ("header", "file")]
            self.commits.append({"route": route, "files": files, "other": other})
            return HTTP.Response(
                200,
                json={
                    "commitUrl": "https://huggingface.co/org/x/commit/" + "a" * 40,
                    "commitOid": "a" * 40,
                    "pullRequestUrl": None,
                },
            )
        return HTTP.Response(404, json={"error": f"no route {route}"})

    def writes(self) -> list[tuple[str, str]]:
        """The requests that change something on the hub (not GET, not the card's validation)."""
        return [r for r in self.requests if r[0] != "GET" and r[1] != "/api/validate-yaml"]


def failing_commit(status: int) -> Callable[[Any], Any]:
    """A ``FakeHub.fail`` that answers ``status`` to the commit and lets every other request through."""
    return lambda request: HTTP.Response(status, json={"error": "failed"}) if "/commit/" in request.url.path else None


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A FakeHub that huggingface_hub's client talks to, with offline mode off."""
    hub = FakeHub()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    _http.set_client_factory(lambda: HTTP.Client(transport=HTTP.MockTransport(hub.handle)))
    yield hub
    _http.set_client_factory(_http.default_client_factory)
