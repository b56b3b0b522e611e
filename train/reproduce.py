"""`python -m train.reproduce`: the old name of `python -m experiments.reproduce`, kept for one release."""
if __name__ == "__main__":
    import runpy
    runpy.run_module("experiments.reproduce", run_name="__main__", alter_sys=True)
