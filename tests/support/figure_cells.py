"""Cells the figure tests share (the kernel program, the pool, saved kernels)."""

from __future__ import annotations

# A 3D surface, kept in `fig` and `ax`: a later cell's plt.bar shows whether it drew on a new 2D figure.
SURFACE = (
    "import numpy as np\n"
    "import matplotlib.pyplot as plt\n"
    "x, y = np.meshgrid(np.linspace(-3, 3, 30), np.linspace(-3, 3, 30))\n"
    "fig = plt.figure()\n"
    "ax = fig.add_subplot(111, projection='3d')\n"
    "ax.plot_surface(x, y, np.sin(np.hypot(x, y)))"
)
