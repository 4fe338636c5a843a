"""server/inprocess.py: a Flower Grid whose simulated sites run a ClientApp in this process, one
Context per node and run, the Simulation Engine's error replies, a reply cache."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from server.inprocess import InProcessGrid
from strategies.common import error_reason

app = ClientApp()


@app.query("echo")
def echo(message: Message, context: Context) -> Message:
    """The site's partition, how many messages its Context saw this run, its torch threads."""
    seen = int(context.state["seen"]["n"]) + 1 if "seen" in context.state else 1
    context.state["seen"] = ConfigRecord({"n": seen})
    if message.content["config"]["fail"]:
        raise RuntimeError("this site fails")
    return Message(RecordDict({"metrics": MetricRecord({
        "partition": int(context.node_config["partition-id"]), "seen": seen,
        "sites": int(context.node_config["num-partitions"]),
        "threads": torch.get_num_threads()})}), reply_to=message)


def _ask(node: int, fail: bool = False) -> Message:
    return Message(RecordDict({"config": ConfigRecord({"fail": fail})}), node, "query.echo")


def test_sites_are_partitions_with_a_context_per_run():
    grid = InProcessGrid(3, client_app=app, threads=1)
    nodes = sorted(grid.get_node_ids())
    assert len(nodes) == 3
    assert all(grid.context(n).node_config["site-mode"] == "simulation" for n in nodes)
    before = torch.get_num_threads()
    asked = [_ask(n, fail=n == nodes[2]) for n in nodes]
    replies = sorted(grid.send_and_receive(asked), key=lambda r: r.metadata.src_node_id)
    assert torch.get_num_threads() == before  # the sites' thread count, then the process's
    metrics = [dict(r.content["metrics"]) for r in replies[:2]]
    assert [(m["partition"], m["sites"], m["seen"], m["threads"]) for m in metrics] == [
        (0, 3, 1, 1), (1, 3, 1, 1)]
    assert [r.metadata.reply_to_message_id for r in replies] == [m.metadata.message_id
                                                                   for m in asked]
    # an exception is the Simulation Engine's error reply, which the strategies name
    assert replies[2].has_error()
    assert error_reason(replies[2].error.reason)[0] == (
        "client error: <class 'RuntimeError'>:<'this site fails'>")
    # the Context's state lasts for the run; a new run starts afresh
    ids = grid.push_messages([_ask(nodes[0])])
    (again,) = grid.pull_messages(ids)
    assert again.content["metrics"]["seen"] == 2 and list(grid.pull_messages(ids)) == []
    run = grid.run.run_id
    assert grid.new_run() == run + 1 and grid.run.run_id == run + 1
    (fresh,) = grid.send_and_receive([_ask(nodes[0])])
    assert fresh.content["metrics"]["seen"] == 1 and fresh.metadata.run_id == run + 1


def test_a_kept_reply_is_served_without_the_client_app():
    class Cache:
        def __init__(self):
            self.kept: dict[int, Message] = {}

        def get(self, message, context):
            kept = self.kept.get(context.node_id)
            return None if kept is None else Message(kept.content, reply_to=message)

        def put(self, message, context, reply):
            self.kept[context.node_id] = reply

    grid = InProcessGrid(2, client_app=app, cache=Cache())
    node = min(grid.get_node_ids())
    (first,) = grid.send_and_receive([_ask(node)])
    (second,) = grid.send_and_receive([_ask(node)])
    assert first.content["metrics"]["seen"] == second.content["metrics"]["seen"] == 1
    assert grid.cached_replies == 1 and grid.client_seconds > 0


def test_a_grid_needs_a_site():
    with pytest.raises(ValueError, match="at least 1"):
        InProcessGrid(0, client_app=app)
