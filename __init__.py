"""The root of a qgemv source checkout (the package is the qgemv/ folder inside).

Python imports this file as ``qgemv`` when the parent directory of a
checkout named ``qgemv`` is on sys.path, e.g. ``python -c "import qgemv"``
run from that parent, or pytest treating the checkout as a package.  Without
this file the checkout would become an empty namespace package that shadows
the real one (no QuantLinear, no ops).  With it, ``qgemv`` is the package in
qgemv/: its submodules are found there and its __init__ runs here.  Under any
other name (a checkout called something else) the file does nothing.
"""

if __name__ == "qgemv":
    import os as _os

    __path__ = [_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "qgemv")]
    __file__ = _os.path.join(__path__[0], "__init__.py")
    with open(__file__, encoding="utf-8") as _f:
        exec(compile(_f.read(), __file__, "exec"))
