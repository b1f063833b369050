"""Suite-wide settings.

The tests run tiny models whose ops are microseconds long; torch's intra-op
thread pool costs more than it saves there, and on a loaded 2-core CI machine
its spinning threads slowed the engine tests 60x (62 s vs 1 s for one test).
One thread keeps the suite fast and its timings stable.
"""

import torch

torch.set_num_threads(1)
