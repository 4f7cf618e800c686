"""Where the run errors lived before the execution layer had its own module.

Failures stored in the result backend by those versions name this module
(``exc_module``), and Celery's backend finds an error's class only in a
module already imported: ``loomflow_worker.tasks`` imports this one, so a
caller reading such a result gets the class, not a stand-in."""

from ..execution.errors import AttemptLost as AttemptLost
from ..execution.errors import RunCancelled as RunCancelled
from ..execution.errors import RunDead as RunDead
from ..execution.errors import RunFailed as RunFailed
