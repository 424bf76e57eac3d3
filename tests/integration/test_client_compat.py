"""loadtest.tools.client_compat against a real stack on the real SmolLM2: every check of every
client library the test extra installs passes, none of them reaches beyond loopback, and the
README's compatibility table is the one generated from this run's result (a stale table fails).
One stack (one decode worker) for every client."""

from __future__ import annotations

import json

import pytest

from loadtest.tools import client_compat
from test_agent_clients import offline  # noqa: F401 — fixture

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
# declared in pyproject's test extra: missing, the test fails rather than reports them not installed
REQUIRED = {"openai (Python)", "openai-agents", "langchain-openai", "litellm", "pydantic-ai"}
REGENERATE = "python -m loadtest.tools.client_compat --start-tandem --readme"


@pytest.mark.filterwarnings("ignore:Items? .* the `ReadOnly` qualifier:UserWarning")  # litellm's types, at import
def test_every_installed_client_passes_and_the_readme_table_is_this_runs(one_worker_stack, offline):  # noqa: F811
    """Over a minute: the stack's start (about 40 s) and some 50 short requests from six clients, one
    after another (about a minute on an idle 2-core machine)."""
    result = client_compat.run(client_compat.Target(one_worker_stack.base_url, MODEL), client_compat.CLIENTS)
    print(json.dumps(result, indent=2))  # shown with -s: versions, times and errors
    installed = {c["client"] for c in result["clients"] if c["installed"]}
    assert REQUIRED <= installed, f"not installed: {sorted(REQUIRED - installed)}"
    assert not client_compat.failures(result), client_compat.failures(result)
    readme = client_compat.README.read_text()
    assert client_compat.table_in(readme) == client_compat.table(result), \
        f"README.md's client table is not this run's: regenerate it with {REGENERATE}"


def test_a_failure_is_in_the_table_and_a_missing_library_is_not_installed():
    """Without a stack: a check that raises is a failure with its error, a client whose library is
    missing is "not installed" in every cell it has a check for, and the README keeps the rest of
    its text when the table between the markers is replaced."""
    def broken(target):
        raise ConnectionError("refused")

    clients = [client_compat.Client("here", lambda: "1.0", {"chat": broken, "stream": lambda target: None}),
               client_compat.Client("absent", lambda: None, {"chat": broken})]
    result = client_compat.run(client_compat.Target("http://127.0.0.1:9", MODEL), clients)
    assert client_compat.failures(result) == [("here", "chat", "ConnectionError: refused")]
    rows = client_compat.table(result).splitlines()
    assert rows[2].startswith("| here | fails | passes | — |"), rows
    assert rows[3].startswith("| absent | not installed | — |"), rows
    assert rows[-1] == "- here, Chat: ConnectionError: refused"
    readme = f"intro\n{client_compat.BEGIN}\nold\n{client_compat.END}\nrest\n"
    assert client_compat.with_table(readme, "new") == f"intro\n{client_compat.BEGIN}\nnew\n{client_compat.END}\nrest\n"
