"""The attacker's ServerApp: one ``query.attack`` to every SuperNode, and every site's report in
``OUT/report.json`` (the SuperLink's runs volume; tests/test_hostile_app.py copies it out)."""

from __future__ import annotations

import json
import os
import time

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    sites = int(config["sites"])
    deadline = time.monotonic() + 300
    while len(nodes := list(grid.get_node_ids())) < sites:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(nodes)} of {sites} SuperNodes connected")
        time.sleep(1)
    content = {"needles": str(config["needles"]), "model": str(config["model"]),
               "sites": sites}
    messages = [Message(RecordDict({"config": ConfigRecord(content)}), dst_node_id=node,
                        message_type="query.attack") for node in nodes]
    reports = {}
    for reply in grid.send_and_receive(messages, timeout=1200):
        node = str(reply.metadata.src_node_id)
        reports[node] = (json.loads(reply.content["report"]["json"]) if not reply.has_error()
                         else {"error": reply.error.reason})
    out = str(config["out"])
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(reports, f, indent=1)
