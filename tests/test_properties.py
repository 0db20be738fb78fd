"""Properties of the validator over generated plans (see ``tests/strategies.py``).

A valid plan gets no diagnostic at all; each injected conflict is reported with its
code; each value a field refuses is refused when the plan is built, naming the field;
no plan, however broken, makes a rule crash; plans survive a YAML round trip; and the
derived views (DAG, PIECEWISE regions) are consistent.
"""

from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphflow.errors import FieldError
from graphflow.plan.loader import dump_plan, loads_plan
from graphflow.plan import Mode, Plan
from graphflow.plan.rules import RETIRED, RULES, Severity, validate
from strategies import FIELD_MUTATIONS, MUTATIONS, VALIDATE_ARGS, valid_plans


@given(valid_plans())
def test_valid_plans_get_no_diagnostic(plan: Plan):
    assert validate(plan).diagnostics == ()


def test_every_rule_has_a_mutation():
    assert sorted(MUTATIONS) == [rule.code for rule in RULES]


def test_no_rule_reuses_a_retired_code():
    assert not set(RETIRED) & {rule.code for rule in RULES}


#: A third of the profile's examples per mutation (34 classes): the mutations are
#: deterministic, so the variety comes from the plans, and the suite stays fast.
MUTATION_SETTINGS = settings(max_examples=max(10, settings.default.max_examples // 3))


@pytest.mark.parametrize("code", sorted(MUTATIONS))
@MUTATION_SETTINGS
@given(plan=valid_plans())
def test_each_mutation_is_reported_with_its_code(code: str, plan: Plan):
    assert code in validate(MUTATIONS[code](plan), **VALIDATE_ARGS.get(code, {})).codes()


@pytest.mark.parametrize("field", sorted(FIELD_MUTATIONS))
@MUTATION_SETTINGS
@given(plan=valid_plans())
def test_each_refused_value_fails_when_the_plan_is_built_naming_its_field(field: str, plan: Plan):
    with pytest.raises(FieldError) as info:
        FIELD_MUTATIONS[field](plan)
    assert info.value.field.split(".")[0].split("[")[0] == field
    assert str(info.value).startswith(f"'{info.value.field}' must be ")


SEVERITY = {rule.code: rule.severity for rule in RULES}


@given(valid_plans(), st.lists(st.sampled_from(sorted(MUTATIONS)), min_size=2, max_size=6))
def test_rules_never_crash_on_plans_broken_many_ways(plan: Plan, codes: list[str]):
    for code in codes:
        plan = MUTATIONS[code](plan)
    report = validate(plan)
    assert bool(report.errors) == any(SEVERITY[code] is Severity.ERROR for code in codes)
    for diagnostic in report.diagnostics:
        assert diagnostic.element and "\n" not in str(diagnostic)


def test_a_warning_mutation_does_not_compile_a_segment_that_breaks():
    # Found by the test above: the GF703 mutation compiled the first graph segment even
    # when it declares breaks, which is the GF704 error, not a warning.
    import attrs

    from plans.toy_model import toy_plan

    plan = toy_plan(1)
    first = next(i for i, s in enumerate(plan.segments) if s.is_graph)
    segments = list(plan.segments)
    segments[first] = attrs.evolve(segments[first], breaks=("layers.*.attn",))
    report = validate(MUTATIONS["GF703"](attrs.evolve(plan, segments=segments)))
    assert not report.errors and "GF703" in {d.code for d in report.diagnostics}


@given(valid_plans())
def test_plans_round_trip_through_yaml(plan: Plan):
    assert loads_plan(dump_plan(plan)) == plan


@given(valid_plans())
def test_dag_of_a_valid_plan_is_acyclic_and_follows_list_order(plan: Plan):
    dag = plan.dag()
    position = {s.name: i for i, s in enumerate(plan.segments)}
    assert nx.is_directed_acyclic_graph(dag)
    assert set(dag.nodes) == set(position)
    assert all(position[u] < position[v] for u, v in dag.edges)


@given(valid_plans())
def test_piecewise_regions_partition_the_graph_segments(plan: Plan):
    regions = plan.regions(Mode.PIECEWISE)
    captured = [name for region in regions for name in region.segments]
    assert sorted(captured) == sorted(s.name for s in plan.segments if s.is_graph)
    for region in regions:
        members = [plan.segment(name) for name in region.segments]
        assert all(s.family == region.family for s in members)
        family = [s.name for s in plan.family_segments(region.family)]
        start = family.index(region.segments[0])
        assert family[start:start + len(members)] == list(region.segments)  # a contiguous run of the family's step
