"""Export a trained ensemble as safetensors plus JSON metadata, and load it back without a Trainer or pickle.

Files written to the export directory:

- ``ensemble.safetensors``: every tensor of the ensemble (members, combination weights, stacking snapshots and
  statistics) and of the preprocessing (``data.feature_normalizer.*``, ``data.target_transform.*``);
- ``<member>.safetensors``: for use outside foxhunt, each member's network that trades, alone, under the keys of the
  member's ``network``: a forecaster's network; an agent's validation-selected weights (``policy_net``) once it chose
  some, else its learning network; no tensor at all when the agent's selection chose flat (it trades nothing). Its
  safetensors header and ``metadata.json`` ``members.<name>.traded`` say which (``network``, ``policy_net`` or
  ``flat``; an agent's header also records ``selected_update``);
- ``<member>.onnx`` and ``<member>.int8.onnx``, when ``python -m foxhunt.export --onnx [--int8]`` wrote them: the
  traded network as an ONNX graph (float, and statically quantised), each listed with its SHA-256 and named inputs and
  outputs under ``serving`` in ``metadata.json``;
- ``metadata.json``: format version, package versions, the fit config, each member's class, hyperparameters and run
  values, the data spec the members were bound to (feature names in column order, known-future inputs, symbols,
  window sizes), the data fingerprint, the latest validation back-test, the SHA-256 of every tensor file it lists
  (``sha256``) and the SHA-256 of its own canonical form (``metadata_sha256``: sorted keys, no spaces, ASCII, of
  everything but ``metadata_sha256`` and the file hashes in ``sha256``, which the files themselves check).

Every file is written atomically (a temporary file beside it, fsync, rename), metadata.json last. ``load`` verifies
metadata.json's own SHA-256 and each listed file's, validates every metadata field it reads (keys, types, finite
values, the spec, the feature names against the registry, the spec and the normaliser), refuses non-finite tensors
and tensors of another dtype or shape than the model's, and checks that each ``<member>.safetensors`` holds exactly
the weights the loaded member trades with: each refusal is one ``ExportError`` line naming the file and the field or
tensor.

Modules: ``metadata`` (the format, ``ExportError``, metadata.json's schema, digest and validation, the seen span),
``symbols`` (bars' symbols as the export's codes, by name, and the rule for a symbol it never saw), ``traded``
(which network of a member trades, and its tensors), ``write`` (``export_ensemble``), ``load`` (``foxhunt.load``: the
verified loader and ``LoadedEnsemble``), ``splits`` (the splits of the data an export was fitted on, rebuilt from its
config), ``onnx`` and ``quantise`` (each member's traded network as ONNX and static int8, recorded under
``serving`` in metadata.json: ``python -m foxhunt.export --onnx EXPORT [--int8]``, docs/SERVING.md).
"""
