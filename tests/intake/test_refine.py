"""Units that adapt (pipeplan.intake.refine): heavy units are split, down to graph nodes if needed; at
least P units; regular models keep one unit per block; the choice is recorded and rebuilt."""

from __future__ import annotations

import torch
from torch import nn

from pipeplan.intake.graph import group_units
from pipeplan.intake.refine import node_costs, refine_units
from pipeplan.intake.trace import TracedModel, trace_model


class Wrapper(nn.Module):
    """A body Sequential of 25 mixed layers, one of them dominant, and an output layer."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for k in range(12):
            wide = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 16))
            layers += [wide if k == 5 else nn.Linear(16, 16), nn.Tanh()]
        self.body = nn.Sequential(*layers, nn.Linear(16, 16))
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


class Blocks(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
            for _ in range(n)
        )
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _refine(model: nn.Module, p: int, batch: int = 4) -> tuple[TracedModel, list, tuple]:
    x = torch.randn(batch, 8 if isinstance(model, Blocks) else 16)
    traced = trace_model(model, (x,))
    units, opened = refine_units(traced, node_costs(traced, (x,)), p)
    return traced, units, opened


def test_items_of_a_mixed_sequential_are_units() -> None:
    traced = trace_model(Wrapper(), (torch.randn(2, 16),))
    names = [u.name for u in group_units(traced)]
    assert names == [f"body.{k}" for k in range(25)] + ["out"]


def test_a_dominant_layer_is_split_to_its_children() -> None:
    _, units, opened = _refine(Wrapper(), 8)
    names = [u.name for u in units]
    assert opened == ("body.10",)
    assert names[10:13] == ["body.10.0", "body.10.1", "body.10.2"] and len(names) == 28


def test_regular_blocks_stay_whole_and_few_blocks_are_refined() -> None:
    _, units, opened = _refine(Blocks(24), 8)
    assert opened == () and [u.name for u in units][1:25] == [f"blocks.{k}" for k in range(24)]
    _, units, opened = _refine(Blocks(6), 16)
    assert len(units) >= 16 and all(o.startswith("blocks.") for o in opened)


def test_at_least_p_units_down_to_graph_nodes() -> None:
    net = nn.Sequential(nn.Linear(16, 16), nn.Sequential(nn.Linear(16, 16), nn.ReLU()))
    traced = trace_model(net, (torch.randn(2, 16),))
    units, _ = refine_units(traced, node_costs(traced, (torch.randn(2, 16),)), 3)
    assert [u.name for u in units] == ["0", "1.0", "1.1"]
    units, _ = refine_units(traced, node_costs(traced, (torch.randn(2, 16),)), 10)
    assert len(units) == 3  # three compute nodes: as many units as the graph has


def test_the_choice_does_not_depend_on_the_batch_and_is_rebuilt_from_the_record() -> None:
    torch.manual_seed(0)
    model = Blocks(3)
    traced, units_4, opened_4 = _refine(model, 8, batch=4)
    _, units_1, opened_1 = _refine(model, 8, batch=1)
    assert opened_4 == opened_1 and opened_4
    assert [u.nodes for u in units_4] == [u.nodes for u in units_1]
    rebuilt = group_units(traced, "auto", opened_4)
    assert [u.nodes for u in rebuilt] == [u.nodes for u in units_4]


def test_node_costs_leave_buffers_alone() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    x = torch.randn(8, 4)
    traced = trace_model(net, (x,))
    before = [b.clone() for b in net.buffers()]
    costs = node_costs(traced, (x,))
    assert all(torch.equal(a, b) for a, b in zip(before, net.buffers()))
    assert costs["_0"] >= 2 * 8 * 4 * 4  # the Linear's multiply-adds


class Glue(nn.Module):
    """One module and elementwise glue in ``forward``: no module opening splits it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lin(x).chunk(2, dim=-1)  # a tuple and its items: never cut between them
        return torch.sin(torch.relu(a * 2 + 1) + b)


def test_glue_is_cut_between_graph_nodes_until_there_are_p_units() -> None:
    x = torch.randn(4, 16)
    traced = trace_model(Glue(), (x,))
    assert [u.name for u in group_units(traced)] == ["root"]
    units, opened = refine_units(traced, node_costs(traced, (x,)), 3)
    assert len(units) == 3 and all(o.startswith("cut:") for o in opened)
    assert [u.nodes for u in group_units(traced, "auto", opened)] == [u.nodes for u in units]
    units, _ = refine_units(traced, node_costs(traced, (x,)), 16)
    chunk = next(u for u in units if "chunk" in u.nodes)
    assert chunk.nodes[-3:] == ("chunk", "getitem", "getitem_1")  # the tuple stays whole
    assert [u.name for u in units][-4:] == ["[add]", "[relu]", "[add_1]", "[sin]"]


def test_never_fewer_units_than_stages_where_the_graph_has_the_nodes() -> None:
    for model in (Wrapper(), Blocks(2), Glue()):
        x = torch.randn(4, 8 if isinstance(model, Blocks) else 16)
        traced = trace_model(model, (x,))
        compute = sum(1 for n in traced.gm.graph.nodes if n.op.startswith("call_"))
        costs = node_costs(traced, (x,))
        reachable = compute - 2 if isinstance(model, Glue) else compute  # chunk + its items
        for p in range(1, compute + 2):
            units, opened = refine_units(traced, costs, p)
            assert len(units) >= min(p, reachable), (type(model).__name__, p, opened)
            assert len({u.name for u in units}) == len(units)
