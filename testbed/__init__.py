"""Many local geotrain nodes behind emulated WAN links, with faults and an all-reduce baseline.

Importing this package must stay cheap: it pulls in `node` and `gossip` (for configs, identities
and scenario figures) but never torch or matplotlib; those load when a run or a plot needs them.
"""

from ._run import RunOptions as RunOptions
from ._run import TestbedError as TestbedError
from ._run import run_testbed as run_testbed
from ._scenario import DEFAULT_SCENARIO as DEFAULT_SCENARIO
from ._scenario import Fault as Fault
from ._scenario import Region as Region
from ._scenario import ScenarioError as ScenarioError
from ._scenario import TestbedScenario as TestbedScenario
from ._scenario import builtin_scenarios as builtin_scenarios
from ._scenario import load_scenario as load_scenario
from ._scenario import scenario_from_dict as scenario_from_dict
from ._summary import build_summary as build_summary
from ._summary import render_table as render_table
