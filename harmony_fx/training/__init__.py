"""What ``harmony_fx.Trainer`` is made of, one concern a module.

``loss``: the model and its loss as one captured module, a batch as its call, the microbatches'
weights. ``updates``: the host optimizer's update of each pack, whatever the axes (in this process
or across processes, state in host memory or on the NVMe tier, per pack during the backward or at
the step's end, clipped or not). ``transaction``: a step is all or nothing (undo copies, the tier's
begin and commit, the ranks' agreement). ``checkpoint`` and ``checkpoint_folders``: the state a
checkpoint holds, in one file or in folders any number of processes read. ``stats``: a step's
figures, the Trainer's own beside the iteration's.
"""
