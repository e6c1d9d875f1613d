"""The zero-copy snapshot machinery under ``Checkpointer``, reusable by adapters (``tierckpt.dcp``).

Building blocks, in the order a save uses them:

* ``flatten``  (pure)  state dict <-> JSON tree + tensors + pickled objects
* ``layout``   (pure)  tensors -> data files, aligned offsets (``plan_layout`` -> ``LayoutPlan``)
* ``pool``             ``SlotPool``/``Slot``: pre-faulted, CUDA-pinned mapped data files reused across steps,
                       prepared in the background (warm-up)
* ``shardfile``        ``MappedFile``: one preallocated, mapped, populated data file
* ``copy``             ``copy_into`` (training thread), ``region_crcs``/``file_crc`` (background),
                       ``write_tensors`` (both, for adapters)
* ``devstage``         device staging: what the D2H copy cannot hide is snapshotted into GPU memory first
* ``commit``           ``commit_files``: checksums, sync, objects.pkl, manifest, COMMIT
* ``handle``           ``SaveHandle``: snapshot-done and committed signals
* ``restore``          ``open_data_files``, ``tensor_views``, ``read_objects``, ``load_into``
* ``bindings``         where a state's tensors live in a destination dict, kept between loads and saves
* ``rankdir``          a rank directory's writer side: step scan, writer lock, crash cleanup, retention
* ``loader``           ``Checkpointer.load``'s steps: candidate steps, manifest cache, reading one step
* ``agree``            cross-rank step agreement at load time
* ``staging``          waiting for the replicator's restore status

An adapter writes a step with::

    plan = layout.plan_layout(specs)
    slot = pool.take(step, plan)                       # files now in step-<step>/, mapped
    crcs = copy.write_tensors(slot.views(plan), tensors)  # or copy_into + commit.checksum_slot
    commit.commit_files(step_dir, who, plan, slot.files, tree=..., manifest_kind="dcp", extra=...)
    pool.committed(step, slot)
"""
