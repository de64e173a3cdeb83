# ctest_costs.cmake — the long tests first. `ctest -j` starts tests in order of their COST, or of
# their definition when it has no timing history (a fresh build: CI); the long ones defined last
# then ran alone at the end while the other core idled (the sanitizer run: 815 s for 1,045 s of
# CPU on 2 cores). Included after the discovered tests (TEST_INCLUDE_FILES; the tests added in
# tests/CMakeLists.txt itself set their COST there); a name that is no longer a test is ignored, so
# keep the list in step with renames. Seconds under ASan + UBSan on a
# 2-core Xeon (Cascade Lake); only their order matters, and a later run's own history replaces them.
foreach(cost IN ITEMS
    Quantize.ModelDirectoriesLoadAsStored=197
    SdpaVariants.BackwardMatchesReferenceOnEveryPath=189
    SdpaVariants.BlockSparseLayouts=164
    SdpaBackward.LongKeyRangesSpanSeveralKeyGroups=150
    SdpaVariants.ForwardMatchesReferenceOnEveryPath=113
    Quantize.BrokenDirectoriesAndFilesAreClearErrors=108
    Linear.BatchInvariantRowsDoNotDependOnTheBatch=56
    Study.SoftmaxLearnsToCopyAWindowCannot=51
    Linear.MatchesFloat64OnOddShapesAndStrides=51
    Sdpa.TilesSharingAKeySweep=46
    Sdpa.Bf16WithinTwiceNaiveBf16Error=41
    SdpaVariants.HeadMaskSkipsHeads=40
    Sdpa.GridMatchesReference=35
    Precision.SentenceEmbeddingsStayCloseToF32=34
    SdpaBackward.FastMatchesReferenceOnTheGrid=34
    Sdpa.Bf16WideningIsTheF32KernelRoundedOnce=29
    SdpaVariants.LongWindowsSkipBlocksAndStayExact=26
    LinearAttention.ChunkedBackwardOnLongSequences=25
    Sdpa.KeyChunksOfFewTilesMergeExactly=16
    SdpaKv.StoredKeysAndValuesMatchReferenceOnEveryPath=12
    ServeService.EmbedsAsTheEncoderDoesUnderLimitsAndManyThreads=12
    LinearAttention.KeyPaddingMask=11
    SdpaBackward.LargeWriteOnceGradientsAreStreamed=11
    Tokenizer.StretchesGiveTheIdsOfTheWholeText=10)
  string(REPLACE "=" ";" pair "${cost}")
  list(GET pair 0 name)
  list(GET pair 1 seconds)
  set_tests_properties("${name}" PROPERTIES COST "${seconds}")
endforeach()
