"""What the tests share: one scriptable fake backend, one fake metrics endpoint, one bounded wait, ports.

Import from here (`from tests.support import FakeBackend, until`), not from another folder's test modules.
"""

from tests.support.backend import FakeBackend, Seen
from tests.support.metrics import FakeMetrics, agent_page
from tests.support.net import established_to, free_port
from tests.support.wait import until

__all__ = ["FakeBackend", "FakeMetrics", "Seen", "agent_page", "established_to", "free_port", "until"]
