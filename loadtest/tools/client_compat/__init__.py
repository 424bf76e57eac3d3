"""Client compatibility: each client library people use, in its documented default usage, against a
running Tandem gateway; per client and feature, passes or fails (with the error); a JSON result;
and the README's compatibility table generated from that result, never written by hand.

    python -m loadtest.tools.client_compat --url http://127.0.0.1:8000
    python -m loadtest.tools.client_compat --start-tandem --readme   # starts `tandem up` here, rewrites the table
    python -m loadtest.tools.client_compat --render loadtest/results/clients/clients.json   # the table alone

A client whose library is not installed is reported as "not installed", never as passing; a feature
a client has no API for is "—". Each check (``checks_*.py``, one module per client) is a small
function that raises on anything a user of that client would call a failure: an exception, a reply
its own types cannot parse, a call whose arguments are not JSON. Generation is short and greedy
where the client lets it be set, so a run takes about a minute on a CPU.

Not covered: llama-index's ``OpenAILike`` (llama-index-llms-openai-like 0.8 requires openai below 3,
and would replace the openai SDK the other checks run).
"""

from __future__ import annotations

from loadtest.tools.client_compat import (checks_agents, checks_langchain, checks_litellm, checks_npm, checks_openai,
                                          checks_pydantic_ai)
from loadtest.tools.client_compat.base import FEATURES, Client, Target
from loadtest.tools.client_compat.report import BEGIN, END, README, failures, run, table, table_in, with_table

CLIENTS: list[Client] = [m.CLIENT for m in (checks_openai, checks_agents, checks_langchain, checks_litellm,
                                            checks_pydantic_ai, checks_npm)]

__all__ = ["BEGIN", "CLIENTS", "END", "FEATURES", "README", "Client", "Target", "failures", "run", "table",
           "table_in", "with_table"]
