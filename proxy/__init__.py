"""affinity-proxy.

Importing the package first lets `proxy.native.loader` decide whether the hot path's compiled modules (a
`python -m proxy.native build`) match the source; if they do, they are what `import proxy.<module>` loads.
"""

from proxy.native.loader import install as _install_native

_install_native()
