"""``spec_arguments``: the options of ``fleet rollout`` that describe a rollout, parsed back by the command's own
parser into the same spec (the console starts rollouts with them)."""

import argparse

import pytest

from agent.cli.fleet import add_arguments
from agent.cli.fleet_options import rollout_spec
from agent.fleet.plan import RolloutSpec, spec_arguments

SHA = "ab" * 32


def parsed(spec):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return rollout_spec(parser.parse_args(["rollout"] + spec_arguments(spec)))


@pytest.mark.parametrize("spec", [
    RolloutSpec(group="site-a", bundle="v2", sha256=SHA),
    RolloutSpec(group="g", bundle="https://artifacts.lan/b.tar.gz", sha256=SHA, prefix="site/x",
                archive_sha256="cd" * 32, canary=0, waves=1, wave_size=7, max_failures=2, max_failure_rate=0.125,
                min_executed=3, confirm_timeout_s=33.5, rollback_on_abort=True, wait_offline_s=60.0,
                step_timeout_s=12.25, retries=0, max_per_minute=30, max_per_type={"timed_out": 1, "failed": 0},
                continue_after_canary_failure=True, pause_after_canary=True, revert_timeout_s=45.0,
                shadow_frames=50, min_agreement=0.9, shadow_sample=0.5, shadow_timeout_s=300.0),
], ids=["defaults", "every-option"])
def test_the_arguments_of_a_spec_parse_back_into_the_same_spec(spec):
    if spec.wave_size is not None:  # --waves and --wave-size exclude each other: waves keeps its default
        spec = RolloutSpec(**dict(spec.__dict__, waves=3))
    assert parsed(spec) == spec
