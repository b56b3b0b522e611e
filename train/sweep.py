"""`python -m train.sweep`: the old name of `python -m experiments.sweep`, kept for one release."""
if __name__ == "__main__":
    import runpy
    runpy.run_module("experiments.sweep", run_name="__main__", alter_sys=True)
