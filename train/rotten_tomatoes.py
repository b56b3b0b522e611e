"""`python -m train.rotten_tomatoes`: the old name of `python -m finetune.rotten_tomatoes`, kept for one release."""
if __name__ == "__main__":
    import runpy
    runpy.run_module("finetune.rotten_tomatoes", run_name="__main__", alter_sys=True)
