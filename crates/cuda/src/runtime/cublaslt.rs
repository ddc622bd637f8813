// SPDX-License-Identifier: MPL-2.0
//! Owners of cuBLASLt's handle and descriptors: each is destroyed by its `Drop`, from the
//! moment it is created, so that no error path leaks one.
//!
//! cudarc's safe cuBLASLt layer (`CudaBlasLT`, `Matmul`) is not used: its layout, descriptor
//! and preference types are private to cudarc, `CudaBlasLT::new` allocates a workspace of
//! its own (after querying the compute capability), and its matmul takes typed slices and
//! one data type for all operands and for the scale, where ours are raw arena addresses
//! with an fp32 scale and compute for fp16 operands. The `cublasLtMatmul` call itself stays
//! with its caller, in an `unsafe` block: its soundness rests on the plan's addresses.

use std::ffi::c_void;

use cudarc::cublaslt::{result as ltr, sys as lt};

use crate::error::{Error, Result};
use trtclassify_compiler::ir::Act;
use trtclassify_compiler::plan::{DType, QuantFormat};

/// The most algorithms asked of cuBLASLt's heuristic for a product: its first is not always
/// the fastest on the GPU (the build times them), and later ones rarely are.
pub(super) const CANDIDATES: usize = 8;

/// A cuBLASLt handle.
pub(super) struct Handle(lt::cublasLtHandle_t);

impl Handle {
    /// A new handle.
    pub(super) fn new() -> Result<Self> {
        ltr::create_handle()
            .map(Handle)
            .map_err(Error::cublas("handle"))
    }

    /// The handle, for calls on it.
    pub(super) fn raw(&self) -> lt::cublasLtHandle_t {
        self.0
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created in `Handle::new` and used by nothing now.
        let _ = unsafe { ltr::destroy_handle(self.0) };
    }
}

/// A matrix product's types and epilogue.
pub(super) struct MatmulDesc(lt::cublasLtMatmulDesc_t);

impl MatmulDesc {
    /// The descriptor, for calls on it.
    pub(super) fn raw(&self) -> lt::cublasLtMatmulDesc_t {
        self.0
    }
}

impl Drop for MatmulDesc {
    fn drop(&mut self) {
        // SAFETY: created in `GemmDescs::new` and used by nothing else.
        let _ = unsafe { ltr::destroy_matmul_desc(self.0) };
    }
}

/// One operand's type, shape, leading dimension and batch.
pub(super) struct MatrixLayout(lt::cublasLtMatrixLayout_t);

impl MatrixLayout {
    fn new(ty: lt::cudaDataType_t, rows: usize, cols: usize, ld: usize) -> Result<Self> {
        ltr::create_matrix_layout(ty, rows as u64, cols as u64, ld as i64)
            .map(MatrixLayout)
            .map_err(Error::cublas("layout"))
    }

    /// The layout, for calls on it.
    pub(super) fn raw(&self) -> lt::cublasLtMatrixLayout_t {
        self.0
    }

    /// `count` matrices, `stride` elements apart.
    fn set_batch(&self, count: i32, stride: i64) -> Result<()> {
        // SAFETY: attributes of the types cuBLASLt documents for them, on a live layout.
        unsafe {
            ltr::set_matrix_layout_attribute(
                self.0,
                lt::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                &count as *const i32 as *const c_void,
                std::mem::size_of::<i32>(),
            )
            .map_err(Error::cublas("batch count"))?;
            ltr::set_matrix_layout_attribute(
                self.0,
                lt::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                &stride as *const i64 as *const c_void,
                std::mem::size_of::<i64>(),
            )
            .map_err(Error::cublas("batch stride"))
        }
    }
}

impl Drop for MatrixLayout {
    fn drop(&mut self) {
        // SAFETY: created in `MatrixLayout::new` and used by nothing else.
        let _ = unsafe { ltr::destroy_matrix_layout(self.0) };
    }
}

/// What the algorithm search may use: here, the workspace size.
struct MatmulPref(lt::cublasLtMatmulPreference_t);

impl Drop for MatmulPref {
    fn drop(&mut self) {
        // SAFETY: created in `GemmDescs::new` and used by nothing else.
        let _ = unsafe { ltr::destroy_matmul_pref(self.0) };
    }
}

/// cuBLASLt descriptors and the chosen algorithm of one matrix product (destroyed in field
/// order).
pub(super) struct GemmDescs {
    pub(super) desc: MatmulDesc,
    pub(super) a: MatrixLayout,
    pub(super) b: MatrixLayout,
    pub(super) c: MatrixLayout,
    pub(super) algo: lt::cublasLtMatmulAlgo_t,
    /// cuBLASLt's candidates for the product, its heuristic's first first, which the build
    /// times (`Runtime::tune_gemm`); only the stored one where a plan names it.
    candidates: Vec<lt::cublasLtMatmulAlgo_t>,
    /// Whether `algo` is the stored one the descriptors were made with (`with_algo`).
    stored: bool,
    /// The activation left for an element-wise pass after the product: GELU where no
    /// algorithm of cuBLASLt takes it in the epilogue for this shape.
    pub(super) act_after: Act,
    /// For an 8-bit product: whether it writes the step's output itself (`scaled_fp8`),
    /// rather than sums that a pass of ours scales back.
    pub(super) scaled: bool,
}

/// The epilogue of an FP8 product that writes its step's output (`GemmDescs::scaled_fp8`):
/// device addresses of the per-channel scales (`n` f32) and of `rows` f32 ones, the bias,
/// the activation, and the output's type.
pub(super) struct ScaledEpilogue {
    pub(super) w_scales: u64,
    pub(super) ones: u64,
    pub(super) bias: Option<u64>,
    pub(super) act: Act,
    pub(super) out: DType,
}

/// The shape of a plan's matrix product: `batch` products y[rows, n] = x[rows, k] · w[k, n],
/// `x` and `y` matrices `x_batch` and `y_batch` elements apart (`x_batch` 0: one `x` for
/// all), `w` stored as `[n, k]` where `w_transposed`, `y` in f32 where `y_f32` (the scores).
#[derive(Debug)]
pub(super) struct GemmShape {
    pub(super) batch: usize,
    pub(super) rows: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) x_batch: usize,
    pub(super) y_batch: usize,
    pub(super) w_transposed: bool,
    pub(super) y_f32: bool,
}

impl GemmDescs {
    /// The descriptors of `shape` in `dtype`, with the bias at device address `bias` and
    /// `act` (None, ReLU or GELU) in the epilogue, and the algorithm cuBLASLt's heuristic
    /// picks for a workspace of `workspace` bytes. Where no algorithm takes GELU in its
    /// epilogue, the product is planned without it and GELU left to `act_after`.
    pub(super) fn new(
        handle: &Handle,
        dtype: DType,
        shape: &GemmShape,
        bias: Option<u64>,
        act: Act,
        workspace: usize,
        stored: Option<[u64; 8]>,
    ) -> Result<Self> {
        match Self::with_epilogue(handle, dtype, shape, bias, act, workspace, stored) {
            Err(Error::NoGemmAlgorithm { .. }) if act == Act::Gelu => {
                let descs =
                    Self::with_epilogue(handle, dtype, shape, bias, Act::None, workspace, stored)?;
                Ok(GemmDescs {
                    act_after: Act::Gelu,
                    ..descs
                })
            }
            descs => descs,
        }
    }

    fn with_epilogue(
        handle: &Handle,
        dtype: DType,
        shape: &GemmShape,
        bias: Option<u64>,
        act: Act,
        workspace: usize,
        stored: Option<[u64; 8]>,
    ) -> Result<Self> {
        let GemmShape {
            batch,
            rows,
            n,
            k,
            x_batch,
            y_batch,
            w_transposed,
            y_f32,
        } = *shape;
        let ty = data_type(dtype);
        // Row-major y[rows, n] = x[rows, k] · w[k, n] is, column-major, yᵀ = wᵀ · xᵀ:
        // A = w as n×k (ld n), B = x as k×rows (ld k), C = y as n×rows (ld n); the bias runs
        // along C's rows, one value per output.
        let desc = ltr::create_matmul_desc(
            lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lt::cudaDataType_t::CUDA_R_32F,
        )
        .map(MatmulDesc)
        .map_err(Error::cublas("descriptor"))?;
        // A `w` stored as row-major [n, k] is, column-major, k×n (ld k): A is its transpose.
        let a = match w_transposed {
            false => MatrixLayout::new(ty, n, k, n)?,
            true => MatrixLayout::new(ty, k, n, k)?,
        };
        let b = MatrixLayout::new(ty, k, rows, k)?;
        // fp16 operands with an f32 result is one of cuBLASLt's documented combinations.
        let c_ty = match y_f32 {
            true => lt::cudaDataType_t::CUDA_R_32F,
            false => ty,
        };
        let c = MatrixLayout::new(c_ty, n, rows, n)?;
        if batch > 1 {
            // Consecutive weights; `x` and `y` at their strides (a stride of 0 reads one
            // matrix for every product, as cuBLASLt allows).
            let count = i32::try_from(batch).map_err(|_| Error::TooManyProducts(batch))?;
            for (layout, stride) in [(&a, n * k), (&b, x_batch), (&c, y_batch)] {
                layout.set_batch(count, stride as i64)?;
            }
        }
        set_epilogue(&desc, bias, act, n)?;
        if w_transposed {
            set_transpose_a(&desc)?;
        }
        Self::with_algo(handle, desc, [a, b, c], workspace, [rows, k, n], stored)
    }

    /// The descriptors of `d[rows, n] = x[rows, k] · w[n, k]ᵀ` with 8-bit operands in
    /// `format` (`w` stored `[n, k]`, as cuBLASLt's 8-bit kernels want A transposed) and
    /// `d` the sums: int32 for int8 (cuBLASLt's integer products; their scalars are int32),
    /// f32 for FP8. No epilogue: the sums are scaled back per channel after (quant.cu).
    /// `stored` as in `with_algo`.
    pub(super) fn eight_bit(
        handle: &Handle,
        format: QuantFormat,
        [rows, k, n]: [usize; 3],
        workspace: usize,
        stored: Option<[u64; 8]>,
    ) -> Result<Self> {
        use lt::cudaDataType_t as T;
        let (compute, scalar, operand, sums) = match format {
            QuantFormat::Int8 => (
                lt::cublasComputeType_t::CUBLAS_COMPUTE_32I,
                T::CUDA_R_32I,
                T::CUDA_R_8I,
                T::CUDA_R_32I,
            ),
            QuantFormat::Fp8 => (
                lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                T::CUDA_R_32F,
                T::CUDA_R_8F_E4M3,
                T::CUDA_R_32F,
            ),
        };
        let desc = ltr::create_matmul_desc(compute, scalar)
            .map(MatmulDesc)
            .map_err(Error::cublas("descriptor"))?;
        // As in `with_epilogue`, column-major: A = w (k×n, ld k, transposed), B = x (k×rows),
        // D = the sums (n×rows).
        let a = MatrixLayout::new(operand, k, n, k)?;
        let b = MatrixLayout::new(operand, k, rows, k)?;
        let c = MatrixLayout::new(sums, n, rows, n)?;
        set_transpose_a(&desc)?;
        Self::with_algo(handle, desc, [a, b, c], workspace, [rows, k, n], stored)
    }

    /// The descriptors of `y[rows, n] = act(x[rows, k] · w[n, k]ᵀ · scale + bias + z)` with
    /// FP8 operands, `scale` each output channel's weight scale times the step's `alpha`
    /// (the scalar: the input's scale times the product's alpha), `z` the residual as C: one
    /// pass, the output written by cuBLASLt's epilogue. The weight scales are an outer
    /// vector of A; B's is `rows` ones, as cuBLASLt takes outer-vector scales on both
    /// operands or neither. `None` where this cuBLASLt has no such algorithm (before CUDA
    /// 12.9, or an activation its epilogue lacks): the step then runs as `eight_bit` does.
    /// `stored` as in `with_algo`.
    pub(super) fn scaled_fp8(
        handle: &Handle,
        [rows, k, n]: [usize; 3],
        epilogue: &ScaledEpilogue,
        workspace: usize,
        stored: Option<[u64; 8]>,
    ) -> Result<Option<Self>> {
        use lt::cudaDataType_t as T;
        if !matches!(epilogue.act, Act::None | Act::Relu | Act::Gelu) {
            return Ok(None);
        }
        let desc =
            ltr::create_matmul_desc(lt::cublasComputeType_t::CUBLAS_COMPUTE_32F, T::CUDA_R_32F)
                .map(MatmulDesc)
                .map_err(Error::cublas("descriptor"))?;
        let a = MatrixLayout::new(T::CUDA_R_8F_E4M3, k, n, k)?;
        let b = MatrixLayout::new(T::CUDA_R_8F_E4M3, k, rows, k)?;
        let c = MatrixLayout::new(data_type(epilogue.out), n, rows, n)?;
        set_transpose_a(&desc)?;
        set_epilogue(&desc, epilogue.bias, epilogue.act, n)?;
        use lt::cublasLtMatmulDescAttributes_t as A;
        let outer = lt::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
        for (attribute, what) in [
            (A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, "scale mode"),
            (A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, "scale mode"),
        ] {
            set_desc(&desc, attribute, &(outer as i32), what)?;
        }
        set_desc(
            &desc,
            A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
            &epilogue.w_scales,
            "scales",
        )?;
        set_desc(
            &desc,
            A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
            &epilogue.ones,
            "scales",
        )?;
        match Self::with_algo(handle, desc, [a, b, c], workspace, [rows, k, n], stored) {
            Ok(descs) => Ok(Some(GemmDescs {
                scaled: true,
                ..descs
            })),
            Err(Error::NoGemmAlgorithm { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The descriptors with the algorithm `stored` (`algo_words` of an earlier choice), where
    /// cuBLASLt confirms that it runs them within `workspace` bytes; otherwise with
    /// cuBLASLt's candidate algorithms for them, its heuristic's first chosen.
    fn with_algo(
        handle: &Handle,
        desc: MatmulDesc,
        [a, b, c]: [MatrixLayout; 3],
        workspace: usize,
        [rows, k, n]: [usize; 3],
        stored: Option<[u64; 8]>,
    ) -> Result<Self> {
        if let Some(data) = stored {
            let algo = lt::cublasLtMatmulAlgo_t { data };
            let mut result: lt::cublasLtMatmulHeuristicResult_t =
                // SAFETY: a plain C struct for cuBLASLt to fill.
                unsafe { std::mem::zeroed() };
            // SAFETY: live descriptors; `algo` and `result` are read and written as
            // cuBLASLt documents.
            let status = unsafe {
                lt::cublasLtMatmulAlgoCheck(
                    handle.raw(),
                    desc.0,
                    a.0,
                    b.0,
                    c.0,
                    c.0,
                    &algo,
                    &mut result,
                )
            };
            let runs = status == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                && result.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                && result.workspaceSize <= workspace;
            if runs {
                return Ok(Self::with_candidates(desc, [a, b, c], vec![algo], true));
            }
            log::debug!(target: trtclassify_compiler::LOG_TARGET,
                "cuBLASLt does not take the stored algorithm for these descriptors of a {rows}x{k} · {k}x{n} product ({status:?}, {:?}): its heuristic's candidates instead",
                result.state);
        }
        let mut results: [lt::cublasLtMatmulHeuristicResult_t; CANDIDATES] =
            // SAFETY: a plain C struct for cuBLASLt to fill.
            unsafe { std::mem::zeroed() };
        let mut returned = 0;
        // SAFETY: attributes of the types cuBLASLt documents for them, on live descriptors;
        // `results` holds as many entries as asked for.
        let found = unsafe {
            let pref = ltr::create_matmul_pref()
                .map(MatmulPref)
                .map_err(Error::cublas("preference"))?;
            ltr::set_matmul_pref_attribute(
                pref.0,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &workspace as *const usize as *const c_void,
                std::mem::size_of::<usize>(),
            )
            .map_err(Error::cublas("preference"))?;
            lt::cublasLtMatmulAlgoGetHeuristic(
                handle.raw(),
                desc.0,
                a.0,
                b.0,
                c.0,
                c.0,
                pref.0,
                CANDIDATES as i32,
                results.as_mut_ptr(),
                &mut returned,
            )
            .result()
            // `pref` is destroyed here, as soon as the search is done.
        };
        let no_algorithm = |source| Error::NoGemmAlgorithm { rows, k, n, source };
        found.map_err(no_algorithm)?;
        let candidates: Vec<lt::cublasLtMatmulAlgo_t> = (results.iter())
            .take(returned.max(0) as usize)
            .filter(|r| r.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|r| r.algo)
            .collect();
        if candidates.is_empty() {
            return Err(no_algorithm(cudarc::cublaslt::result::CublasError(
                lt::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED,
            )));
        }
        Ok(Self::with_candidates(desc, [a, b, c], candidates, false))
    }

    /// The descriptors running the first of `candidates` (not empty), `stored` where that is
    /// the stored algorithm they were asked for.
    fn with_candidates(
        desc: MatmulDesc,
        [a, b, c]: [MatrixLayout; 3],
        candidates: Vec<lt::cublasLtMatmulAlgo_t>,
        stored: bool,
    ) -> Self {
        GemmDescs {
            desc,
            a,
            b,
            c,
            algo: candidates[0],
            candidates,
            stored,
            act_after: Act::None,
            scaled: false,
        }
    }

    /// Whether the product runs the stored algorithm it was made with.
    pub(super) fn runs_stored(&self) -> bool {
        self.stored
    }

    /// How many algorithms cuBLASLt offers for the product.
    pub(super) fn candidates(&self) -> usize {
        self.candidates.len()
    }

    /// The algorithm chosen, as the words of cuBLASLt's `cublasLtMatmulAlgo_t`: cuBLASLt
    /// documents that it can be stored and used again with the same library version, which
    /// the engine file is keyed to.
    pub(super) fn algo_words(&self) -> [u64; 8] {
        self.algo.data
    }

    /// Runs the product with cuBLASLt's candidate `rank` (0 the heuristic's first; the
    /// algorithm unchanged where it offers fewer).
    pub(super) fn choose(&mut self, rank: usize) {
        if let Some(&algo) = self.candidates.get(rank) {
            self.algo = algo;
        }
    }
}

/// cuBLASLt's type of values of `dtype`.
fn data_type(dtype: DType) -> lt::cudaDataType_t {
    match dtype {
        DType::F16 => lt::cudaDataType_t::CUDA_R_16F,
        DType::F32 => lt::cudaDataType_t::CUDA_R_32F,
    }
}

/// Sets the attribute `attribute` of `desc` to `value`, of the type cuBLASLt documents for it.
fn set_desc<V>(
    desc: &MatmulDesc,
    attribute: lt::cublasLtMatmulDescAttributes_t,
    value: &V,
    what: &'static str,
) -> Result<()> {
    // SAFETY: the callers pass values of the type cuBLASLt documents for each attribute; the
    // descriptor is live.
    unsafe {
        ltr::set_matmul_desc_attribute(
            desc.0,
            attribute,
            value as *const V as *const c_void,
            std::mem::size_of::<V>(),
        )
    }
    .map_err(Error::cublas(what))
}

/// The epilogue of `desc`: the bias at device address `bias` (`n` values a product) and
/// `act` (None, ReLU or GELU), applied after the residual (C) is added.
fn set_epilogue(desc: &MatmulDesc, bias: Option<u64>, act: Act, n: usize) -> Result<()> {
    use lt::cublasLtEpilogue_t as E;
    use lt::cublasLtMatmulDescAttributes_t as A;
    let epilogue = match (bias.is_some(), act) {
        (true, Act::Relu) => E::CUBLASLT_EPILOGUE_RELU_BIAS,
        (false, Act::Relu) => E::CUBLASLT_EPILOGUE_RELU,
        (true, Act::Gelu) => E::CUBLASLT_EPILOGUE_GELU_BIAS,
        (false, Act::Gelu) => E::CUBLASLT_EPILOGUE_GELU,
        (true, Act::None) => E::CUBLASLT_EPILOGUE_BIAS,
        (false, Act::None) => E::CUBLASLT_EPILOGUE_DEFAULT,
        _ => {
            return Err(Error::Plan(
                "a matrix product with an activation its epilogue lacks",
            ));
        }
    };
    set_desc(
        desc,
        A::CUBLASLT_MATMUL_DESC_EPILOGUE,
        &epilogue,
        "epilogue",
    )?;
    if let Some(ptr) = bias {
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr, "bias")?;
        // Each product its own bias: `n` values apart.
        let stride = n as i64;
        set_desc(
            desc,
            A::CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE,
            &stride,
            "bias stride",
        )?;
    }
    Ok(())
}

/// Makes the product read A transposed.
fn set_transpose_a(desc: &MatmulDesc) -> Result<()> {
    // cublasOperation_t's CUBLAS_OP_T (cuBLAS's enum, not in cudarc's cuBLASLt bindings): an
    // int32 attribute.
    let op: i32 = 1;
    let transa = lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA;
    set_desc(desc, transa, &op, "transpose")
}
