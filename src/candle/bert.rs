//! [`OutOfCoreBert`]: candle-transformers' BERT run one layer at a time through [`Layers`].

use std::collections::{BTreeSet, HashMap};

use candle_core::{DType as CDType, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertEncoder, BertModel, Config};

use super::Layers;

/// candle-transformers' `BertModel`, run out of core: the embeddings, then each encoder layer,
/// each built from weights fetched by [`Layers::fetch`] just before it runs (the next stage
/// prefetched meanwhile) and dropped after it.
///
/// Every stage is candle-transformers' own code: the embeddings are a `BertModel` of no encoder
/// layer, each layer a `BertEncoder` of one layer. So the same candle ops run in the same order
/// as in `BertModel::forward`, and the output is the same, bit for bit. The word-embedding
/// table does not go to the device: the rows the input uses are gathered on the host
/// ([`Layers::gather_rows`]) and the embedding runs on that sub-table with the ids renumbered,
/// which selects the same rows.
///
/// The tensors are looked for at the root, under `bert.`, or under the config's `model_type`
/// (`BertModel::load` looks under `bert.` only when a tensor named `bert` exists: this accepts
/// what it accepts, and a little more).
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use candle_core::{DType, Device, Tensor};
/// use strata as st;
/// use st::candle::{Layers, OutOfCoreBert};
///
/// let device = Device::Cpu;
/// let store = st::candle::store_for(
///     &device,
///     st::Store::builder().capacity(st::Tier::Device, 8 << 20).prefetch_budget(8 << 20),
/// )?;
/// let loaded =
///     store.load_checkpoint("all-MiniLM-L6-v2/model.safetensors", st::LoadOptions::default())?;
/// let config = serde_json::from_str(&std::fs::read_to_string("all-MiniLM-L6-v2/config.json")?)?;
/// let bert = OutOfCoreBert::new(Layers::from_loaded(store, &loaded, &device)?, &config, DType::F32)?;
/// let ids = Tensor::new(&[[101u32, 7592, 2088, 102]], &device)?;
/// let hidden = bert.forward(&ids, &ids.zeros_like()?, None)?; // [1, 4, 384]
/// # let _ = hidden; Ok(()) }
/// ```
pub struct OutOfCoreBert {
    layers: Layers,
    config: Config,
    dtype: CDType,
    /// Where the model's tensors are: "", "bert." or "<model_type>.".
    root: String,
    /// The embeddings' tensors, the word table apart.
    embeddings: Vec<String>,
    /// Each encoder layer's tensors.
    encoder: Vec<Vec<String>>,
    /// Modules kept across forwards ([`OutOfCoreBert::with_resident`]).
    resident: Resident,
}

/// The part of the model kept built, its weights held by candle: the first encoder layers, and
/// with all of them the embeddings too (the whole word table).
#[derive(Default)]
struct Resident {
    embeddings: Option<BertModel>,
    encoder: Vec<BertEncoder>,
}

impl std::fmt::Debug for OutOfCoreBert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutOfCoreBert")
            .field("root", &self.root)
            .field("layers", &self.encoder.len())
            .field("resident_layers", &self.resident.encoder.len())
            .field("dtype", &self.dtype)
            .finish()
    }
}

const WORD: &str = "embeddings.word_embeddings.weight";

impl OutOfCoreBert {
    /// A BERT of `config` over the tensors `layers` serves, computing in `dtype`. Fails with
    /// `CannotFindTensor` when the word-embedding table or an encoder layer's tensors are
    /// missing (a missing tensor inside a layer is reported when that layer loads).
    pub fn new(layers: Layers, config: &Config, dtype: CDType) -> candle_core::Result<Self> {
        let mut roots = vec![String::new(), "bert.".to_string()];
        if let Some(t) = &config.model_type {
            roots.push(format!("{t}."));
        }
        let root = roots
            .into_iter()
            .find(|r| layers.id(&format!("{r}{WORD}")).is_some())
            .ok_or_else(|| candle_core::Error::CannotFindTensor { path: WORD.to_string() }.bt())?;
        let owned = |v: Vec<&str>| v.into_iter().map(str::to_string).collect::<Vec<_>>();
        let word = format!("{root}{WORD}");
        let embeddings = owned(layers.names_under(&format!("{root}embeddings.")))
            .into_iter()
            .filter(|n| *n != word)
            .collect();
        let mut encoder = Vec::with_capacity(config.num_hidden_layers);
        for l in 0..config.num_hidden_layers {
            let prefix = format!("{root}encoder.layer.{l}.");
            let names = owned(layers.names_under(&prefix));
            if names.is_empty() {
                return Err(
                    candle_core::Error::CannotFindTensor { path: format!("{prefix}*") }.bt()
                );
            }
            encoder.push(names);
        }
        Ok(OutOfCoreBert {
            layers,
            config: config.clone(),
            dtype,
            root,
            embeddings,
            encoder,
            resident: Resident::default(),
        })
    }

    /// Keeps the first `k` encoder layers built, their weights held as candle tensors on the
    /// layers' device across forwards (fetched once, here); the others are still fetched per
    /// forward. With `k` the number of layers (or more) the whole model is kept, the embeddings
    /// with the whole word table included, and a forward runs as `BertModel::forward` does in
    /// memory (no host sync for the ids). The output is the same, bit for bit, whatever `k`.
    /// Those weights live outside the store's budgets: choose `k` with
    /// [`OutOfCoreBert::layers_within`].
    pub fn with_resident(mut self, k: usize) -> candle_core::Result<Self> {
        let k = k.min(self.encoder.len());
        let dev = self.layers.device().clone();
        let mut resident = Resident::default();
        for l in 0..k {
            let names: Vec<&str> = self.encoder[l].iter().map(String::as_str).collect();
            resident.encoder.push(self.encoder_layer(l, &names, &[])?);
        }
        if k == self.encoder.len() {
            let word = format!("{}{WORD}", self.root);
            let names: Vec<&str> =
                self.embeddings.iter().map(String::as_str).chain([word.as_str()]).collect();
            let weights = self.layers.fetch(&names, &[])?.into_tensors();
            let vb = self.rooted(VarBuilder::from_tensors(weights, self.dtype, &dev));
            let config = Config { num_hidden_layers: 0, ..self.config.clone() };
            resident.embeddings = Some(BertModel::load(vb, &config)?);
        }
        self.resident = resident;
        Ok(self)
    }

    /// How many first encoder layers fit in `bytes` (their weights as stored; with every layer,
    /// the embeddings too): the `k` for [`OutOfCoreBert::with_resident`] that a device budget
    /// allows.
    pub fn layers_within(&self, bytes: u64) -> candle_core::Result<usize> {
        let size = |names: &[String]| -> candle_core::Result<u64> {
            names.iter().try_fold(0u64, |acc, n| {
                let id = self
                    .layers
                    .id(n)
                    .ok_or_else(|| candle_core::Error::CannotFindTensor { path: n.clone() }.bt())?;
                Ok(acc + self.layers.store().info(id).map_err(candle_core::Error::from)?.bytes)
            })
        };
        let mut used = 0u64;
        let mut k = 0;
        for names in &self.encoder {
            used += size(names)?;
            if used > bytes {
                return Ok(k);
            }
            k += 1;
        }
        let word = [format!("{}{WORD}", self.root)];
        if used + size(&self.embeddings)? + size(&word)? > bytes {
            // Every layer fits, the embeddings do not: keep all but the last layer, so that
            // the embeddings stay streamed.
            return Ok(k.saturating_sub(1));
        }
        Ok(k)
    }

    /// The encoder layers kept built ([`OutOfCoreBert::with_resident`]).
    pub fn resident_layers(&self) -> usize {
        self.resident.encoder.len()
    }

    /// Encoder layer `l` built from its fetched weights (`next` prefetched meanwhile).
    fn encoder_layer(
        &self,
        l: usize,
        names: &[&str],
        next: &[&str],
    ) -> candle_core::Result<BertEncoder> {
        let weights = self.layers.fetch(names, next)?;
        // The layer's tensors under "layer.0." for a one-layer encoder.
        let from = format!("{}encoder.layer.{l}.", self.root);
        let tensors: HashMap<String, Tensor> = weights
            .into_tensors()
            .into_iter()
            .map(|(n, t)| (format!("layer.0.{}", n.strip_prefix(&from).unwrap_or(&n)), t))
            .collect();
        let vb = VarBuilder::from_tensors(tensors, self.dtype, self.layers.device());
        let one = Config { num_hidden_layers: 1, ..self.config.clone() };
        BertEncoder::load(vb, &one)
    }

    /// The [`Layers`] it fetches through (for its [`transfers`](Layers::transfers) and the
    /// store's [`stats`](crate::Store::stats)).
    pub fn layers(&self) -> &Layers {
        &self.layers
    }

    /// `BertModel::forward`: the last hidden state, `[batch, tokens, hidden_size]`, for
    /// `input_ids` and `token_type_ids` (`[batch, tokens]`, `u32` or `i64`) and an optional
    /// attention mask (all ones when `None`).
    pub fn forward(
        &self,
        input_ids: &Tensor,
        token_type_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        // The stages fetched per forward (the embeddings, then each encoder layer not kept):
        // each prefetches the next; the last, the first of the next call.
        let kept = self.resident.encoder.len();
        let mut streamed: Vec<(usize, Vec<&str>)> = Vec::new();
        if self.resident.embeddings.is_none() {
            streamed.push((0, self.embeddings.iter().map(String::as_str).collect()));
        }
        for (l, names) in self.encoder.iter().enumerate().skip(kept) {
            streamed.push((l + 1, names.iter().map(String::as_str).collect()));
        }
        let next = |stage: usize| -> &[&str] {
            match streamed.iter().position(|(s, _)| *s == stage) {
                Some(i) => streamed[(i + 1) % streamed.len()].1.as_slice(),
                None => &[],
            }
        };
        let names = |stage: usize| -> &[&str] {
            streamed.iter().find(|(s, _)| *s == stage).map_or(&[][..], |(_, n)| n.as_slice())
        };

        let embedding_output = match &self.resident.embeddings {
            Some(model) => {
                // The first streamed layer's weights start coming meanwhile.
                if let Some((_, first)) = streamed.first() {
                    self.layers.prefetch(first)?;
                }
                model.forward(input_ids, token_type_ids, None)?
            }
            None => self.streamed_embeddings(input_ids, token_type_ids, names(0), next(0))?,
        };

        let attention_mask = match attention_mask {
            Some(m) => m.clone(),
            None => input_ids.ones_like()?,
        };
        let attention_mask = extended_attention_mask(&attention_mask, embedding_output.dtype())?;

        let mut hidden = embedding_output;
        for l in 0..self.encoder.len() {
            hidden = match self.resident.encoder.get(l) {
                Some(layer) => layer.forward(&hidden, &attention_mask)?,
                None => self
                    .encoder_layer(l, names(l + 1), next(l + 1))?
                    .forward(&hidden, &attention_mask)?,
            };
        }
        Ok(hidden)
    }

    /// The embeddings stage fetched: the word table's rows this input uses gathered on the
    /// host, the ids renumbered into them.
    fn streamed_embeddings(
        &self,
        input_ids: &Tensor,
        token_type_ids: &Tensor,
        names: &[&str],
        next: &[&str],
    ) -> candle_core::Result<Tensor> {
        let dev = self.layers.device();
        let ids = input_ids.to_dtype(CDType::I64)?.to_vec2::<i64>()?;
        let used: BTreeSet<usize> =
            ids.iter().flatten().map(|&i| usize::try_from(i).unwrap_or(usize::MAX)).collect();
        let rows: Vec<usize> = used.iter().copied().collect();
        let word = self.layers.gather_rows(&format!("{}{WORD}", self.root), &rows)?;
        // Every id is in `rows` (sorted): its position there is its new id.
        let renumbered: Vec<u32> = ids
            .iter()
            .flatten()
            .map(|&i| {
                let i = usize::try_from(i).unwrap_or(usize::MAX);
                rows.binary_search(&i)
                    .map(|k| k as u32)
                    .map_err(|_| candle_core::Error::Msg(format!("token id {i} not gathered")).bt())
            })
            .collect::<candle_core::Result<_>>()?;
        let local_ids = Tensor::from_vec(renumbered, input_ids.dims(), dev)?;
        let mut weights = self.layers.fetch(names, next)?.into_tensors();
        weights.insert(format!("{}{WORD}", self.root), word);
        let vb = self.rooted(VarBuilder::from_tensors(weights, self.dtype, dev));
        let config = Config { num_hidden_layers: 0, vocab_size: rows.len(), ..self.config.clone() };
        BertModel::load(vb, &config)?.forward(&local_ids, token_type_ids, None)
    }

    /// `vb` under the model's root (tensor names without it).
    fn rooted(&self, vb: VarBuilder<'static>) -> VarBuilder<'static> {
        match self.root.strip_suffix('.') {
            Some(r) => vb.pp(r),
            None => vb,
        }
    }
}

/// candle-transformers' `get_extended_attention_mask` (private there), the same ops in the same
/// order: 0 where the mask is 1, the dtype's minimum where it is 0, shaped to broadcast over
/// heads and queries.
fn extended_attention_mask(attention_mask: &Tensor, dtype: CDType) -> candle_core::Result<Tensor> {
    let attention_mask = match attention_mask.rank() {
        3 => attention_mask.unsqueeze(1)?,
        2 => attention_mask.unsqueeze(1)?.unsqueeze(1)?,
        _ => candle_core::bail!("Wrong shape for input_ids or attention_mask"),
    };
    let attention_mask = attention_mask.to_dtype(dtype)?;
    (attention_mask.ones_like()? - &attention_mask)?.broadcast_mul(
        &Tensor::try_from(f32::MIN)?.to_device(attention_mask.device())?.to_dtype(dtype)?,
    )
}
