// Renders an Ollama TEMPLATE the way Ollama's server does (template/template.go, Template.Execute on the
// .Messages path): Go's text/template with Option("missingkey=zero") and Ollama's template functions (json,
// currentDate, toTypeScriptType), the messages collated as Ollama's collate() does (system messages gathered into
// .System; consecutive messages of one role other than tool joined by a blank line), and the fields Ollama gives a
// template: .System, .Messages (Role, Content, Thinking, ToolCalls with .ID and .Function.Name/.Arguments, ToolName,
// ToolCallID), .Tools (Ollama's template view of api.Tool: .Function.Name/.Description/.Parameters with .Required and
// .Properties, each property's .Type, .Description, .Enum, .Items), .Response, .Think, .ThinkLevel, .IsThinkSet.
// Tools, properties and arguments print as compact JSON (their String methods); maps range in key order, as in Ollama.
//
// Written for rocktune's tests (no Ollama code): go run ollama_render.go < {"template", "messages", "tools"}
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"text/template"
	"time"
)

type args map[string]any

func (a args) String() string {
	if a == nil {
		return "{}"
	}
	b, _ := json.Marshal(map[string]any(a))
	return string(b)
}

type callFunction struct {
	Index     int
	Name      string
	Arguments args
}

type toolCall struct {
	ID       string
	Function callFunction
}

type message struct {
	Role       string
	Content    string
	Thinking   string
	ToolCalls  []toolCall
	ToolName   string
	ToolCallID string
}

// propertyType is Ollama's api.PropertyType: a JSON type given as a string or a list of them.
type propertyType []string

func (pt *propertyType) UnmarshalJSON(data []byte) error {
	var s string
	if err := json.Unmarshal(data, &s); err == nil {
		*pt = []string{s}
		return nil
	}
	var a []string
	if err := json.Unmarshal(data, &a); err != nil {
		return err
	}
	*pt = a
	return nil
}

func (pt propertyType) MarshalJSON() ([]byte, error) {
	if len(pt) == 1 {
		return json.Marshal(pt[0])
	}
	return json.Marshal([]string(pt))
}

func (pt propertyType) String() string {
	if len(pt) == 0 {
		return ""
	}
	if len(pt) == 1 {
		return pt[0]
	}
	return fmt.Sprintf("%v", []string(pt))
}

// property is Ollama's api.ToolProperty.
type property struct {
	AnyOf       []property           `json:"anyOf,omitempty"`
	Type        propertyType         `json:"type,omitempty"`
	Items       any                  `json:"items,omitempty"`
	Description string               `json:"description,omitempty"`
	Enum        []any                `json:"enum,omitempty"`
	Properties  *map[string]property `json:"properties,omitempty"`
	Required    []string             `json:"required,omitempty"`
}

func tsType(t string) string {
	switch t {
	case "string":
		return "string"
	case "number", "integer":
		return "number"
	case "boolean":
		return "boolean"
	case "array":
		return "any[]"
	case "object":
		return "Record<string, any>"
	case "null":
		return "null"
	}
	return "any"
}

// toTypeScriptType is Ollama's api.ToolProperty.ToTypeScriptType.
func (p property) toTypeScriptType() string {
	var types []string
	if len(p.AnyOf) > 0 {
		for _, a := range p.AnyOf {
			types = append(types, a.toTypeScriptType())
		}
		return strings.Join(types, " | ")
	}
	if len(p.Type) == 0 {
		return "any"
	}
	for _, t := range p.Type {
		types = append(types, tsType(t))
	}
	return strings.Join(types, " | ")
}

type properties map[string]property

func (p properties) String() string {
	if p == nil {
		return "{}"
	}
	b, _ := json.Marshal(map[string]property(p))
	return string(b)
}

type parameters struct {
	Type       string     `json:"type"`
	Defs       any        `json:"$defs,omitempty"`
	Items      any        `json:"items,omitempty"`
	Required   []string   `json:"required,omitempty"`
	Properties properties `json:"properties"`
}

type function struct {
	Name        string     `json:"name"`
	Description string     `json:"description"`
	Parameters  parameters `json:"parameters"`
}

// tool is Ollama's templateTool, the view of api.Tool a template gets.
type tool struct {
	Type     string   `json:"type"`
	Items    any      `json:"items,omitempty"`
	Function function `json:"function"`
}

func (t tool) String() string {
	b, _ := json.Marshal(t)
	return string(b)
}

type tools []tool

func (t tools) String() string {
	b, _ := json.Marshal(t)
	return string(b)
}

type input struct {
	Template string `json:"template"`
	Messages []struct {
		Role             string `json:"role"`
		Content          string `json:"content"`
		Thinking         string `json:"thinking"`
		ReasoningContent string `json:"reasoning_content"`
		ToolCallID       string `json:"tool_call_id"`
		Name             string `json:"name"`
		ToolCalls  []struct {
			ID       string `json:"id"`
			Function struct {
				Name      string         `json:"name"`
				Arguments map[string]any `json:"arguments"`
			} `json:"function"`
		} `json:"tool_calls"`
	} `json:"messages"`
	Tools []tool `json:"tools"`
}

var funcs = template.FuncMap{
	"json": func(v any) string {
		b, _ := json.Marshal(v)
		return string(b)
	},
	"currentDate": func(args ...string) string {
		return time.Now().Format("2006-01-02")
	},
	"toTypeScriptType": func(v any) string {
		if p, ok := v.(property); ok {
			return p.toTypeScriptType()
		}
		return "any"
	},
}

func main() {
	var in input
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var system []string
	var msgs []*message
	for _, m := range in.Messages {
		if m.Role == "system" {
			system = append(system, m.Content)
		}
		if n := len(msgs); n > 0 && msgs[n-1].Role == m.Role && m.Role != "tool" {
			msgs[n-1].Content += "\n\n" + m.Content
			continue
		}
		thinking := m.Thinking
		if thinking == "" {
			thinking = m.ReasoningContent
		}
		msg := &message{Role: m.Role, Content: m.Content, Thinking: thinking, ToolName: m.Name, ToolCallID: m.ToolCallID}
		for i, c := range m.ToolCalls {
			msg.ToolCalls = append(msg.ToolCalls, toolCall{ID: c.ID, Function: callFunction{Index: i, Name: c.Function.Name, Arguments: c.Function.Arguments}})
		}
		msgs = append(msgs, msg)
	}
	ts := tools(in.Tools)
	tmpl, err := template.New("").Option("missingkey=zero").Funcs(funcs).Parse(in.Template)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(3)
	}
	err = tmpl.Execute(os.Stdout, map[string]any{"System": strings.Join(system, "\n\n"), "Messages": msgs,
		"Tools": ts, "Response": "", "Think": false, "ThinkLevel": "", "IsThinkSet": false})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(4)
	}
}
