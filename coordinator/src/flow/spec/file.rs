//! The flow file as data: serde structs for the file, a flow, each operator's step and a
//! route target. Every value is optional here; `lower` fills defaults, checks ranges and
//! builds the operators, naming the place of each problem.

use std::collections::{BTreeMap, HashMap};

use serde::Deserialize;
use serde::de::{self, Visitor};

use super::SpecResult;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileSpec {
    #[serde(default)]
    pub default: String,
    /// Collection name -> default flow for its Asks.
    #[serde(default)]
    pub collections: BTreeMap<String, String>,
    #[serde(default)]
    pub flows: BTreeMap<String, toml::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowSpec {
    #[serde(default)]
    pub description: String,
    pub steps: Option<toml::Value>,
}

/// noop: no settings.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoopSpec {}

/// An LLM query transform (rewrite, hyde, step_back).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmSpec {
    pub template: Option<String>,
    pub system: Option<String>,
    pub max_tokens: Option<usize>,
    pub model: Option<String>,
}

/// multi_query and decompose: an LLM transform producing `n` queries.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueriesSpec {
    pub n: Option<usize>,
    pub template: Option<String>,
    pub system: Option<String>,
    pub max_tokens: Option<usize>,
    pub model: Option<String>,
}

/// bm25, dense, hybrid.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetrieveSpec {
    pub top_k: Option<usize>,
    pub fusion: Option<String>,
    pub dense_weight: Option<f32>,
    pub rrf_k: Option<f32>,
    pub filter: Option<HashMap<String, String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RerankSpec {
    pub model: Option<String>,
    pub keep: Option<usize>,
    pub min_score: Option<f32>,
    pub blend: Option<f32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MmrSpec {
    pub lambda: Option<f32>,
    pub keep: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrevNextSpec {
    pub before: Option<usize>,
    pub after: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThresholdSpec {
    pub min_score: Option<f32>,
    pub keep_fraction: Option<f32>,
    pub keep: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompressSpec {
    pub budget_tokens: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReorderSpec {
    pub mode: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptSpec {
    pub template: Option<String>,
    pub system: Option<String>,
    pub examples: Option<Vec<ExampleSpec>>,
}

/// A worked example of a prompt step (few-shot): asked through the step's template before
/// the question, `answer` as the assistant's reply.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExampleSpec {
    pub title: Option<String>,
    pub context: String,
    pub question: String,
    pub answer: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateSpec {
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub model: Option<String>,
    pub stop: Option<Vec<String>>,
    pub yes_no: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerifySpec {
    pub threshold: Option<f32>,
    pub max_retries: Option<usize>,
    pub widen: Option<usize>,
    pub model: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteSpec {
    pub method: Option<String>,
    pub alpha: Option<f32>,
    pub temperature: Option<f32>,
    pub default: Option<String>,
    pub routes: Option<toml::Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteTargetSpec {
    pub flow: Option<String>,
    #[serde(default)]
    pub keywords: Vec<String>,
    #[serde(default)]
    pub intents: Vec<String>,
    pub form: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JudgeSpec {
    pub rule: Option<String>,
    pub threshold: Option<f32>,
    pub model: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FuseSpec {
    pub method: Option<String>,
    pub k: Option<f32>,
    pub template: Option<String>,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub model: Option<String>,
    pub stop: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BranchSpec {
    pub over: Option<String>,
    pub max_branches: Option<usize>,
    pub steps: Option<toml::Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoopSpec {
    pub max_iterations: Option<usize>,
    pub augment_query: Option<bool>,
    pub steps: Option<toml::Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecurseSpec {
    pub max_depth: Option<usize>,
    pub max_queries: Option<usize>,
    pub template: Option<String>,
    pub system: Option<String>,
    pub max_tokens: Option<usize>,
    pub model: Option<String>,
    pub steps: Option<toml::Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActiveSpec {
    pub mode: Option<String>,
    pub threshold: Option<f32>,
    pub max_sentences: Option<usize>,
    pub max_retrievals: Option<usize>,
    pub sentence_tokens: Option<usize>,
    pub top_k: Option<usize>,
    pub fusion: Option<String>,
    pub dense_weight: Option<f32>,
    pub rrf_k: Option<f32>,
    pub filter: Option<HashMap<String, String>>,
    pub template: Option<String>,
    pub system: Option<String>,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub model: Option<String>,
    pub stop: Option<Vec<String>>,
}

impl ActiveSpec {
    pub fn retrieve(&self) -> RetrieveSpec {
        RetrieveSpec {
            top_k: self.top_k,
            fusion: self.fusion.clone(),
            dense_weight: self.dense_weight,
            rrf_k: self.rrf_k,
            filter: self.filter.clone(),
        }
    }

    pub fn generate(&self) -> GenerateSpec {
        GenerateSpec {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            model: self.model.clone(),
            stop: self.stop.clone(),
            yes_no: None,
        }
    }
}

impl FuseSpec {
    pub fn generate(&self) -> GenerateSpec {
        GenerateSpec {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            model: self.model.clone(),
            stop: self.stop.clone(),
            yes_no: None,
        }
    }
}

impl RecurseSpec {
    pub fn llm(&self) -> LlmSpec {
        LlmSpec {
            template: self.template.clone(),
            system: self.system.clone(),
            max_tokens: self.max_tokens,
            model: self.model.clone(),
        }
    }
}

impl QueriesSpec {
    pub fn llm(&self) -> LlmSpec {
        LlmSpec {
            template: self.template.clone(),
            system: self.system.clone(),
            max_tokens: self.max_tokens,
            model: self.model.clone(),
        }
    }
}

/// The field names serde expects for the struct `T`, asked of its derived `Deserialize` (so
/// an unknown key can be reported with the known ones).
pub fn fields_of<T: for<'de> Deserialize<'de>>() -> &'static [&'static str] {
    struct Probe<'a>(&'a mut &'static [&'static str]);

    impl<'de> serde::Deserializer<'de> for Probe<'_> {
        type Error = de::value::Error;

        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(de::Error::custom("probed"))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }

    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Probe(&mut fields));
    fields
}

/// Reads `t` (the keys other than `skip`) as `T`; errors name `place` and the key.
pub fn read<T: for<'de> Deserialize<'de>>(
    place: &str,
    t: &toml::Table,
    skip: &str,
) -> SpecResult<T> {
    let known = fields_of::<T>();
    if let Some(k) = t
        .keys()
        .find(|k| k.as_str() != skip && !known.contains(&k.as_str()))
    {
        return Err(format!(
            "{place}: unknown key {k:?} (known: {})",
            known.join(", ")
        ));
    }
    let mut t = t.clone();
    t.remove(skip);
    serde_path_to_error::deserialize(toml::Value::Table(t)).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let msg = inner.message().trim();
        if path.is_empty() || path == "." {
            format!("{place}: {msg}")
        } else {
            format!("{place}: {path}: {msg}")
        }
    })
}
